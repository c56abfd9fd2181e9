"""The host protocol as types: every operation's request, payload and receipt.

``piwf.protocol`` gathers the host protocol (``host``, ``controllers``, ``delivery``,
``settings``, ``output``, ``graph``, and the union of requests in ``requests``); the worker's protocol is
``piwf.protocol.worker``, a reconcile worker's ``piwf.protocol.reconcile`` (with the
steering messages of ``steering`` and the resource types of ``resources``); ``doc``
generates docs/protocol.md's reference from all of them.
"""

from piwf.protocol.controllers import *  # noqa: F403
from piwf.protocol.delivery import *  # noqa: F403
from piwf.protocol.graph import *  # noqa: F403
from piwf.protocol.host import *  # noqa: F403
from piwf.protocol.maintenance import *  # noqa: F403
from piwf.protocol.output import *  # noqa: F403
from piwf.protocol.requests import OPERATIONS as OPERATIONS
from piwf.protocol.requests import REQUEST_TYPES as REQUEST_TYPES
from piwf.protocol.requests import AnyRequest as AnyRequest
from piwf.protocol.requests import read_request as read_request
from piwf.protocol.settings import *  # noqa: F403
