"""The host protocol's run-settings operations (DESIGN.md §9b): ``workflow.settings`` and
``workflow.changeSettings``.

Imported by ``piwf.protocol`` (which re-exports every name here and puts the requests in
its union); import them from there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from piwf.protocol.host import NoPayload, RunRequest

__all__ = [
    "SETTINGS_LIMIT", "SETTINGS_REQUESTS", "ChangeSettings", "ChangeSettingsPayload", "ChangeSettingsReceipt",
    "GetSettings", "GetSettingsPayload", "RunSettings", "SettingsChange",
]

SETTINGS_LIMIT = 64 * 1024  # a run's settings, and a patch, as JSON (bytes)
ChangeNumber = Annotated[int, Meta(ge=0)]


# --- payloads ---------------------------------------------------------------------------


class ChangeSettingsPayload(NoPayload, frozen=True):
    patch: Annotated[dict[str, Any], Meta(description="a JSON merge patch (RFC 7396) touching only the workflow's "
                                                      "mutable paths; checked against its settings type")]
    expectedChangeNumber: Annotated[ChangeNumber | None, Meta(description="refused as a `conflict` unless the "
                                                                          "settings are at this change")] = None
    scopeId: Annotated[str | None, Meta(description="the settings scope (a run has one; see `workflow.settings`)")] = (
        None)


class GetSettingsPayload(NoPayload, frozen=True):
    scopeId: Annotated[str | None, Meta(description="the settings scope (default: the run's)")] = None


# --- receipts ---------------------------------------------------------------------------


class SettingsChange(Struct):
    changeNumber: Annotated[int, Meta(description="0: the settings the run started with")]
    actor: Annotated[Literal["start", "client", "controller"], Meta(description="who made the change")]
    actorId: Annotated[str | None, Meta(description="the clientId, or the controller resource's uid")]
    patch: Annotated[Any, Meta(description="the merge patch as given")]
    at: str


class RunSettings(Struct):
    """A run's settings scope: the settings in force now and how they came to be."""

    runId: str
    scopeId: str
    mountPath: Annotated[str, Meta(description="where in the run the scope applies (`\"\"`: the whole run)")]
    changeNumber: Annotated[int, Meta(description="bumped by every accepted change")]
    settings: Annotated[Any, Meta(description="the settings in force: what the next node's `ctx.settings` is")]
    mutable: Annotated[list[str], Meta(description="the paths a change may touch")]
    changes: Annotated[list[SettingsChange], Meta(description="every change, oldest first")]


class ChangeSettingsReceipt(Struct):
    runId: str
    scopeId: str
    changeNumber: Annotated[int, Meta(description="the change number of this change")]
    settings: Annotated[Any, Meta(description="the settings after it")]


# --- requests ---------------------------------------------------------------------------


class GetSettings(RunRequest, tag="workflow.settings"):
    """A run's settings, change number, mutable paths and changes."""

    payload: GetSettingsPayload = GetSettingsPayload()
    is_read = True
    receipt_type = RunSettings


class ChangeSettings(RunRequest, tag="workflow.changeSettings"):
    """Change a live run's settings: a waiting or parked run sees them when it continues, a
    running one at its next node. A compare-and-set on the change number; a run that has
    ended is refused."""

    payload: ChangeSettingsPayload
    receipt_type = ChangeSettingsReceipt


SETTINGS_REQUESTS = (GetSettings, ChangeSettings)
