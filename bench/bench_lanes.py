"""Time to first token of an interactive request while agent streams run, in one run: the
p50 TTFT of a streamed interactive chat when the server is idle, against the same while
``--agents`` agent-lane streams generate (target from issue #15: ≤ 2× idle). Lanes order
admission; on a joinable engine an interactive request joins the running batch at the next
step and, on an engine that is ``EagerJoin``, draws its first token as soon as its prefill
has run. The loaded phase runs ``--rounds`` times in each mode, alternating: with the
eager first token, and without it (the scheduler then draws it with the batch's next step),
so the report gives what the eager first token saves in the same run.

Usage: python bench/bench_lanes.py [--agents 8] [--samples 7] [--rounds 2] [--engine transformers|gguf]

``--engine gguf`` serves the packaged SmolLM2 Q4_1 GGUF instead of the 22M bench model, with
``2 × --agents`` sequences (``--gguf-parallel N`` for another count: with as many sequences
as agents, the interactive request gets the row agents leave free, ``Scheduler.agent_reserve``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Protocol, runtime_checkable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import bench_model_dir, save_results, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

import millm_core.scheduler as scheduler_module  # noqa: E402
from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def ttft(base_url: str, model: str = "bench") -> float:
    """Seconds from sending a streamed interactive chat to its first content chunk."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": True, "temperature": 0}
    started = time.perf_counter()
    with CLIENT.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                return time.perf_counter() - started
    raise RuntimeError("no content chunk")


def agent(base_url: str, stop: threading.Event, model: str = "bench") -> None:
    body = {"model": f"{model}@agent", "prompt": "Write about the sea.", "max_tokens": 256, "temperature": 0}
    while not stop.is_set():
        CLIENT.post(base_url + "/v1/completions", json=body, timeout=600)


@runtime_checkable
class _NeverEager(Protocol):
    """Stands in for EagerJoin in the scheduler for the "without" phases: no engine has it."""

    def _bench_never_defined(self) -> None: ...


def loaded_phase(base_url: str, agents: int, samples: int, model: str) -> list[float]:
    """TTFT samples while ``agents`` agent streams generate; the agents are stopped (and
    their batch drained) before it returns."""
    stop = threading.Event()
    threads = [threading.Thread(target=agent, args=(base_url, stop, model)) for _ in range(agents)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)  # the agents are generating
    out = []
    for _ in range(samples):
        out.append(ttft(base_url, model))
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", choices=["transformers", "gguf"], default="transformers")
    parser.add_argument("--gguf-parallel", type=int, default=0, help="GGUF sequences (default: twice --agents)")
    args = parser.parse_args()
    if args.engine == "gguf":
        from millm_engines.gguf.loader import load_engine as load_gguf
        from millm_engines.gguf.plugin import PARALLEL
        from millm_plugins.smollm2.convert import packaged_gguf

        settings = load_settings(
            {"log_level": "warning", "db": ":memory:", "gguf_parallel": args.gguf_parallel or 2 * args.agents},
            environ={},
            plugin_settings=[PARALLEL],
        )
        load: Any = lambda: load_gguf(ModelLocation(path=packaged_gguf(), served_name="bench"), settings)  # noqa: E731
        name = "SmolLM2-135M-Instruct Q4_1 (GGUF)"
    else:
        settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})
        load = lambda: load_engine(ModelLocation(path=bench_model_dir(), served_name="bench"), settings)  # noqa: E731
        name = "bench (22M, float32)"

    served: list[str] = []

    def loader() -> ServedModel:
        engine = load()
        engine.eos_token_ids = frozenset()  # agents generate their whole budget
        served.append(engine.info.served_name)  # the GGUF engine names its model from the file
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    with RunningServer(app) as server:
        wait_loaded(app)
        model = served[-1]
        ttft(server.base_url, model)  # warm-up
        idle = [ttft(server.base_url, model) for _ in range(args.samples)]
        loaded: dict[str, list[float]] = {"eager": [], "next_step": []}
        eager_join = scheduler_module.EagerJoin
        try:
            for _ in range(args.rounds):
                for mode in loaded:  # a batch checks its engine when it opens: each phase opens its own
                    scheduler_module.EagerJoin = eager_join if mode == "eager" else _NeverEager  # type: ignore[misc]
                    loaded[mode] += loaded_phase(server.base_url, args.agents, args.samples, model)
        finally:
            scheduler_module.EagerJoin = eager_join  # type: ignore[misc]
    p50 = {"idle": statistics.median(idle), **{mode: statistics.median(v) for mode, v in loaded.items()}}
    report: dict[str, Any] = {
        "model": name,
        "agents": args.agents,
        "p50_ttft_s": p50,
        "ratio": p50["eager"] / p50["idle"],
        "ratio_first_token_with_next_step": p50["next_step"] / p50["idle"],
        "samples": {"idle": idle, **loaded},
    }
    print(json.dumps(report))
    print(
        f"\ninteractive TTFT p50: idle {p50['idle'] * 1000:.0f} ms; under {args.agents} agent streams "
        f"{p50['eager'] * 1000:.0f} ms -> {report['ratio']:.2f}x (target <= 2x); with the first token drawn at the "
        f"batch's next step instead: {p50['next_step'] * 1000:.0f} ms -> {report['ratio_first_token_with_next_step']:.2f}x"
    )
    save_results("lanes.json", [report])


if __name__ == "__main__":
    main()
