"""``ctx`` used from several threads of one node: each answer reaches the call that asked,
on the first pass and on replay, and an effect key shared by threads is applied once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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


NESTED_KEY = """
    from piwf import Workflow, compute

    def nest(ctx):
        return ctx.effect("charge", lambda: ctx.effect("charge", lambda: 1))

    workflow = Workflow(name="nested", start_at="nest", nodes={"nest": compute(nest)})
"""


async def test_an_effect_key_used_again_inside_its_own_apply_fails_the_node_not_hangs(
        host: Any, paths: StatePaths, project: Path) -> None:
    write_workflow(project, "nested", NESTED_KEY)
    done = await wait_run(paths, await start(paths, project, "nested"))
    assert done["status"] == "failed", done
    assert "effect 'charge' is already in progress in this attempt" in done["error"]["message"]


STRAGGLER = """
    import threading
    from piwf import Workflow, compute

    def leave(ctx):
        started = threading.Event()

        def apply():
            started.set()
            threading.Event().wait()  # never returns: the node returns meanwhile
        threading.Thread(target=lambda: ctx.effect("charge", apply), daemon=True).start()
        started.wait()
        if ctx.input.get("fail"):
            raise RuntimeError("done with this node")
        return "done"

    workflow = Workflow(name="straggler", start_at="leave", nodes={"leave": compute(leave)})
"""


@pytest.mark.parametrize("fail", [False, True])
async def test_a_run_ended_while_a_thread_still_applies_an_effect_is_held_not_ended(
        host: Any, paths: StatePaths, project: Path, fail: bool) -> None:
    """A thread left in apply() when the node returns (or raises) and the run ends: the
    effect's outcome is unknown, so the run is held for it (never completed or failed)."""
    write_workflow(project, "straggler", STRAGGLER)
    held = await wait_run(paths, await start(paths, project, "straggler", input={"fail": fail}))
    assert (held["status"], held["queueStatus"], held["hold"]) == ("running", "parked", "effect"), held
    assert held["statusDetail"] == "ambiguous effect charge"
    assert [(e["key"], e["status"]) for e in held["effects"]] == [("charge", "ambiguous")]


RENUMBERED = """
    import os, threading
    from pathlib import Path
    from piwf import Workflow, compute

    def fan(ctx):
        marker = Path(ctx.project_path) / "crashed-once"
        first = not marker.exists()
        b_done = threading.Event()

        def a():
            if not first:
                b_done.wait()  # the replay: b's call comes first this time
            ctx.notify("from a")
            if first:
                marker.touch()
                os._exit(9)  # part-way: b never notified on the first pass

        def b():
            ctx.notify("from b")
            b_done.set()

        threads = [threading.Thread(target=a)] + ([] if first else [threading.Thread(target=b)])
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return "done"

    workflow = Workflow(name="renumbered", start_at="fan", nodes={"fan": compute(fan)})
"""


async def test_a_replay_whose_threads_notify_in_another_order_repeats_none_and_drops_none(
        host: Any, paths: StatePaths, project: Path) -> None:
    """After a crash part-way, the replay's threads call in another order: its call with the
    text stored before is that one (matched by text, not call number), and the text never
    sent is stored once (it was: "from a" twice, "from b" never)."""
    write_workflow(project, "renumbered", RENUMBERED)
    run_id = await start(paths, project, "renumbered", originSessionId="renumbered")
    done = await wait_run(paths, run_id)
    assert done["status"] == "completed", done.get("error")
    page = await call(paths, "delivery.list", payload={"sessionId": "renumbered"})
    assert [(n["index"], n["content"]) for n in page["notifications"]] == [(1, "from a"), (2, "from b")]
