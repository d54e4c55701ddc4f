"""Function calling: OpenAI tools, tool_choice and parallel_tool_calls on chat completions."""
