"""Built-in communicators; importing this package registers every module in it."""

from gracecomm.plugins import import_submodules

import_submodules(__name__)
