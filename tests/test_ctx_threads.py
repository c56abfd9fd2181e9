"""``ctx`` used from several threads of one node: each answer reaches the call that asked,
on the first pass and on replay, and an effect key shared by threads is applied once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from piwf.paths import StatePaths

from .conftest import write_workflow
from .test_interactions import start, wait_run
from .test_lifecycle import call

THREADED = """
    import os, threading
    from pathlib import Path
    from piwf import Workflow, compute

    THREADS, CALLS = 8, 6

    def fan(ctx):
        results, errors = {}, []
        barrier = threading.Barrier(THREADS)

        def work(t):
            try:
                barrier.wait()
                for i in range(CALLS):
                    key = f"e{t}-{i}"
                    results[key] = ctx.effect(key, lambda key=key: {"key": key, "pad": "x" * (t * 997)})
                    ctx.notify(f"thread {t} call {i}")
                    ctx.publish("thread", f"t{t}", {"i": i})
            except BaseException as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(errors[0])
        marker = Path(ctx.project_path) / "crashed-once"
        if ctx.input.get("crash") and not marker.exists():
            marker.touch()
            os._exit(9)  # the next worker replays the node: every effect answers from the store
        return {"mixed": sorted(k for k, v in results.items() if v["key"] != k), "count": len(results)}

    workflow = Workflow(name="threaded", start_at="fan", nodes={"fan": compute(fan)})
"""

SHARED_KEY = """
    import threading
    from pathlib import Path
    from piwf import Workflow, compute

    def fan(ctx):
        results = []
        barrier = threading.Barrier(8)

        def apply():
            with open(Path(ctx.project_path) / "applied.log", "a") as f:
                f.write("applied\\n")
            return {"charged": 1}

        def work():
            barrier.wait()
            results.append(ctx.effect("charge", apply))

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    workflow = Workflow(name="shared", start_at="fan", nodes={"fan": compute(fan)})
"""


async def _threaded_run(paths: StatePaths, project: Path, crash: bool) -> tuple[dict[str, Any], list[str]]:
    write_workflow(project, "threaded", THREADED)
    session = f"threads-{crash}"
    run_id = await start(paths, project, "threaded", originSessionId=session, input={"crash": crash})
    done = await wait_run(paths, run_id)
    page = await call(paths, "delivery.list", payload={"sessionId": session})
    return done, [n["content"] for n in page["notifications"]]


async def test_effects_notifications_and_updates_from_threads_each_reach_their_own_call(
        host: Any, paths: StatePaths, project: Path) -> None:
    done, notes = await _threaded_run(paths, project, crash=False)
    assert done["status"] == "completed", done.get("error")
    assert done["output"] == {"mixed": [], "count": 48}
    assert sorted(notes) == sorted(f"thread {t} call {i}" for t in range(8) for i in range(6))
    assert {u["key"]: u["data"] for u in done["updates"]} == {f"t{t}": {"i": 5} for t in range(8)}


async def test_a_replayed_threaded_node_gets_each_effect_its_own_stored_result(
        host: Any, paths: StatePaths, project: Path) -> None:
    done, notes = await _threaded_run(paths, project, crash=True)
    assert done["status"] == "completed", done.get("error")
    assert [w["status"] for w in done["workers"]] == ["crashed", "exited"]
    assert done["output"] == {"mixed": [], "count": 48}  # the replay's results, from the store
    assert len(notes) == 48  # stored once per call number, not again by the replay


async def test_threads_sharing_one_effect_key_apply_it_once(host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "shared", SHARED_KEY)
    done = await wait_run(paths, await start(paths, project, "shared"))
    assert done["status"] == "completed", done.get("error")
    assert done["output"] == [{"charged": 1}] * 8
    assert (project / "applied.log").read_text() == "applied\n"
