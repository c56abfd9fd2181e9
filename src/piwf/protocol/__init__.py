"""The host protocol as types: every operation's request, payload and receipt.

``piwf.protocol`` gathers the host protocol (``host``, ``controllers``, ``delivery``,
``settings``, and the union of requests in ``requests``); the worker's protocol is
``piwf.protocol.worker``, a reconcile worker's ``piwf.protocol.reconcile`` (with the
steering messages of ``steering`` and the resource types of ``resources``); ``doc``
generates docs/protocol.md's reference from all of them.
"""

from piwf.protocol.controllers import *  # noqa: F403
from piwf.protocol.delivery import *  # noqa: F403
from piwf.protocol.host import *  # noqa: F403
from piwf.protocol.requests import OPERATIONS, REQUEST_TYPES, AnyRequest, read_request  # noqa: F401
from piwf.protocol.settings import *  # noqa: F403
