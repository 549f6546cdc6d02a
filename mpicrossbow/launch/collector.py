"""Start-up without needless garbage collections: a rank imports torch with the cyclic collector off, then
freezes what the imports made, and skips the interpreter's last full collection at exit.

Importing torch makes about 250,000 objects the collector tracks, which live as long as the process; each
full collection during the import walks all of them (measured: about 0.5 s of CPU a rank). After
``gc.freeze()`` no later collection walks them (those during set-up, when torch's optimizers import
``torch._dynamo``, training and exit). What the imports left as cyclic garbage (about 7,000 objects here)
stays allocated. The model file, the data and training run with the collector on, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off_then_frozen() -> Iterator[None]:
    """Run the block (importing torch) with the cyclic garbage collector off, then freeze what it made;
    a caller that had the collector off keeps it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@functools.cache
def freeze_objects_at_exit() -> None:
    """Spare this process the interpreter's last full collection when it exits (registered once): with
    torch loaded it walks ~460,000 objects only to free memory the process gives back anyway."""
    atexit.register(gc.freeze)
