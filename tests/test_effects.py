"""Effects end to end: real hosts, real workers, a ledger file as the outside world."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from piwf.client import AsyncClient, make_request
from piwf.paths import StatePaths

from .conftest import HostProcess, piwf, wait_for, write_workflow
from .test_lifecycle import call, run_status

# The outside world is a ledger file: apply() appends the run id, observe() looks for it.
PAY = """
    import os
    from pathlib import Path
    from piwf import Workflow, compute

    def pay(ctx):
        ledger = Path(ctx.input["ledger"])

        def apply():
            with ledger.open("a") as handle:
                handle.write(ctx.run_id + "\\n")
                handle.flush()
                os.fsync(handle.fileno())
            die = ctx.input.get("dieInApply")
            if die and not Path(die).exists():
                Path(die).touch()
                os._exit(9)  # applied, never settled
            return {"charged": ledger.read_text().count(ctx.run_id)}

        def observe():
            if ledger.exists() and ctx.run_id in ledger.read_text():
                return {"charged": 1, "observed": True}
            return None

        result = ctx.effect("charge", apply, observe if ctx.input.get("observe") else None)
        crash = ctx.input.get("crashAfter")
        if crash and not Path(crash).exists():
            Path(crash).touch()
            os._exit(9)  # the node dies after the effect settled
        return result

    workflow = Workflow(
        name="pay",
        start_at="pay",
        nodes={"pay": compute(pay), "receipt": compute(lambda ctx: {"receipt": ctx.outputs["pay"]})},
        edges=[("pay", "receipt")],
    )
"""


@pytest.fixture
def shop(project: Path, tmp_path: Path) -> dict[str, Any]:
    write_workflow(project, "pay", PAY)
    return {"ledger": str(tmp_path / "ledger.txt"), "marker": str(tmp_path / "marker")}


def charges(shop: dict[str, Any]) -> int:
    ledger = Path(shop["ledger"])
    return len(ledger.read_text().splitlines()) if ledger.exists() else 0


async def start_pay(paths: StatePaths, project: Path, run_input: dict[str, Any]) -> str:
    receipt = await call(paths, "run.start", payload={"workflow": "pay", "projectPath": str(project),
                                                      "input": run_input})
    return receipt["runId"]


async def wait_at_rest(paths: StatePaths, run_id: str) -> dict[str, Any]:
    return await call(paths, "run.wait", run_id=run_id, payload={"timeoutMs": 30_000})


def effect_states(run: dict[str, Any]) -> dict[str, str]:
    return {e["key"]: e["status"] for e in run["effects"]}


async def test_a_settled_effect_is_not_applied_again_when_its_node_reruns(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any]
) -> None:
    await host_process().start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "crashAfter": shop["marker"]})
    run = await wait_at_rest(paths, run_id)
    assert run["status"] == "completed", run
    assert charges(shop) == 1
    assert len(run["workers"]) == 2  # the first worker died after the effect settled
    assert run["output"] == {"receipt": {"charged": 1}}
    assert effect_states(run) == {"charge": "applied"}


async def test_a_worker_dying_after_apply_is_resolved_by_observe(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any]
) -> None:
    # Every worker of this host exits at its first "applied, not yet settled" moment.
    await host_process(env={"PIWF_FAULT": "worker.effect.applied:exit"}).start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "observe": True})
    run = await wait_at_rest(paths, run_id)
    assert run["status"] == "completed", run
    assert charges(shop) == 1
    assert run["output"] == {"receipt": {"charged": 1, "observed": True}}
    assert [w["exitCode"] for w in run["workers"]][:1] == [86] and len(run["workers"]) == 2


async def test_an_unobservable_interrupted_effect_holds_the_run_until_an_operator_resolves_it(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any]
) -> None:
    await host_process().start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "dieInApply": shop["marker"]})
    held = await wait_at_rest(paths, run_id)
    assert (held["status"], held["queueStatus"], held["hold"]) == ("running", "parked", "effect")
    assert held["statusDetail"] == "ambiguous effect charge"
    assert effect_states(held) == {"charge": "ambiguous"}
    assert [s["status"] for s in held["steps"]] == ["interrupted", "interrupted"]  # nothing shown running
    shown = await piwf(paths, "run", "show", run_id)
    assert b"ambiguous effect charge" in shown.stdout
    refused = await piwf(paths, "run", "resume", run_id, check=False)
    assert refused.returncode == 1 and b"resolve-effect" in refused.stderr
    assert charges(shop) == 1  # never re-applied on a guess
    status = json.loads((await piwf(paths, "status", "--json")).stdout)
    assert status["ambiguousEffects"] == 1  # seed: host.status counts them
    assert b"1 of runs and 0 of resources ambiguous" in (await piwf(paths, "status")).stdout

    await piwf(paths, "run", "resolve-effect", run_id, "charge", "--applied", "--result", '{"charged": 1}')
    done = await wait_at_rest(paths, run_id)
    assert done["status"] == "completed", done
    assert done["output"] == {"receipt": {"charged": 1}}
    assert charges(shop) == 1
    assert json.loads((await piwf(paths, "status", "--json")).stdout)["ambiguousEffects"] == 0


async def test_resolving_as_not_applied_applies_the_effect_again(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any]
) -> None:
    await host_process().start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "dieInApply": shop["marker"]})
    await wait_for(lambda: _held(paths, run_id))
    Path(shop["ledger"]).write_text("")  # the operator checked: the charge did not go through
    await piwf(paths, "run", "resolve-effect", run_id, "charge", "--not-applied")
    done = await wait_at_rest(paths, run_id)
    assert done["status"] == "completed" and charges(shop) == 1


async def test_resolve_effect_refuses_bad_input_and_changes_nothing(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any]
) -> None:
    await host_process().start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"]})
    assert (await wait_at_rest(paths, run_id))["status"] == "completed"
    cases = [
        (("charge", "--applied"), b"is applied, not ambiguous"),
        (("nope", "--not-applied"), b"has no effect 'nope'"),
        (("charge", "--not-applied", "--result", "1"), b"--result goes with --applied"),
        (("charge", "--applied", "--result", "{bad"), b"--result is not valid JSON"),
    ]
    for args, message in cases:
        done = await piwf(paths, "run", "resolve-effect", run_id, *args, check=False)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert effect_states(await run_status(paths, run_id)) == {"charge": "applied"}
    unknown = await piwf(paths, "run", "resolve-effect", "run-missing", "charge", "--applied", check=False)
    assert unknown.returncode != 0 and b"notFound" in unknown.stderr


async def _held(paths: StatePaths, run_id: str) -> bool:
    return (await run_status(paths, run_id))["hold"] == "effect"


@pytest.mark.parametrize("durability", ["full", "normal"])
async def test_a_host_killed_while_a_worker_applies_loses_nothing_and_applies_once(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any],
    durability: str,
) -> None:
    # The worker stalls right after apply(); the host is SIGKILLed; the next host observes
    # the effect its reservation recorded.
    first = await host_process("--durability", durability, env={"PIWF_FAULT": "worker.effect.applied:sleep"}).start()
    run_id = await start_pay(paths, project, {"ledger": shop["ledger"], "observe": True})
    await wait_for(lambda: charges(shop) == 1)
    first.signal(signal.SIGKILL)
    await first.wait()
    await host_process("--durability", durability).start()
    run = await wait_at_rest(paths, run_id)
    assert run["status"] == "completed", run
    assert charges(shop) == 1
    assert run["output"]["receipt"]["observed"] is True


@pytest.mark.parametrize("durability", ["full", "normal"])
async def test_a_host_killed_after_commit_before_reply_adopts_the_retry(
    host_process: Callable[..., HostProcess], paths: StatePaths, project: Path, shop: dict[str, Any],
    durability: str,
) -> None:
    first = await host_process("--durability", durability, env={"PIWF_FAULT": "host.command.committed:exit"}).start()
    payload = {"workflow": "pay", "projectPath": str(project), "input": {"ledger": shop["ledger"]}}
    request = make_request("run.start", client_id="shop", idempotency_key="order-1", payload=payload)
    async with AsyncClient(paths) as client:
        with pytest.raises(Exception):  # noqa: B017 - the host dies before it can answer
            await client.send(request)
    assert await first.wait() == 86
    await host_process("--durability", durability).start()
    async with AsyncClient(paths) as client:
        retry = await client.send(request)
    assert retry.outcome == "adopted", retry
    run_id = retry.receipt["runId"]
    assert (await wait_at_rest(paths, run_id))["status"] == "completed"
    assert len(await call(paths, "run.list")) == 1
    assert charges(shop) == 1
    events = json.loads((await piwf(paths, "run", "events", run_id, "--json")).stdout)
    assert [e["type"] for e in events].count("effect.applied") == 1
