#!/usr/bin/env bash
# Show what millm reports about a request: the model, the seed's scope, the unused fields.
# Usage: examples/headers.sh [base-url]
set -euo pipefail
BASE="${1:-http://127.0.0.1:8000}"
MODEL=$(curl -sf "$BASE/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
curl -s -D - -o /dev/null "$BASE/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"seed\": 7, \"user\": \"me\", \"max_tokens\": 8,
       \"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"name\": \"ada\"}]}" \
  | grep -i -E '^(x-millm|x-request-id)'
