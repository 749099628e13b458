"""Built-in compressors; importing this package registers every module in it, except
`shared`: the machinery several families use, which registers nothing."""

from gracecomm.plugins import import_submodules

import_submodules(__name__, exclude=("shared",))
