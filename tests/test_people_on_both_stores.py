"""The integration tests of decisions and asks, delivery, watch, controllers and settings
that matter most, again on PostgreSQL: each is imported from its own file (where it runs
on SQLite) and runs here with this module's ``host`` and ``host_process``, whose hosts keep
their store on the session's PostgreSQL (a fresh schema per test; every host of one test
shares it, as hosts sharing a store do)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio

from piwf.host.host import Host
from piwf.host.state import HostState
from piwf.paths import StatePaths

from .conftest import HostProcess, config, pg_store_url
from .conftest import host_process as sqlite_host_process
from .test_controllers import (  # noqa: F401 (collected here: run on PostgreSQL)
    mirror, test_a_child_run_ending_queues_its_resource_and_shows_in_status,
    test_the_sample_controller_converges_rewrites_and_finalizes,
)
from .test_delivery import (  # noqa: F401
    test_each_run_end_gives_its_session_exactly_one_turn_across_a_host_kill_right_after_it,
    test_follow_ups_are_delivered_in_order_with_the_runs_turn,
    test_notifications_reach_the_follower_in_order_again_after_a_crashed_claim_and_never_twice,
    test_two_followers_of_one_session_print_nothing_twice_and_both_keep_going,
)
from .test_interactions import (  # noqa: F401
    test_a_decision_answered_by_piwf_decide_goes_on_along_the_chosen_exit,
    test_a_waiting_run_survives_a_host_kill_and_cancel_closes_its_request,
    test_an_ask_validates_in_the_worker_and_takes_the_first_value_that_fits,
    test_two_clients_racing_on_100_fresh_decisions_have_one_winner_each,
)
from .test_settings import (  # noqa: F401
    test_a_change_accepted_just_before_a_host_sigkill_is_seen_by_the_next_node,
    test_a_waiting_run_gets_a_new_budget_and_its_next_node_sees_it,
)
from .test_settings_controllers import test_a_controller_steers_its_child_run_once_per_request_key  # noqa: F401
from .test_watch import test_an_update_replaces_its_value_and_shows_in_run_status_and_watch  # noqa: F401

del sqlite_host_process  # this module's own is below


@pytest.fixture
def store_url(postgres: Any) -> str:
    """The test's PostgreSQL store (a fresh schema), shared by every host of the test."""
    return pg_store_url(postgres)


@pytest.fixture
async def host(paths: StatePaths, nursery: trio.Nursery, store_url: str) -> AsyncIterator[HostState]:
    """An in-process host on PostgreSQL; real worker processes."""
    state = await nursery.start(Host(config(paths, store_url=store_url)).serve)
    yield state
    state.stop_requested.set()


@pytest.fixture
def host_process(host_process: Callable[..., HostProcess], store_url: str) -> Callable[..., HostProcess]:
    """``piwf serve --store URL`` processes (conftest's, on this test's store)."""
    def make(*extra: str, env: dict[str, str] | None = None) -> HostProcess:
        return host_process("--store", store_url, *extra, env=env)

    return make
