"""`no_host_reads()`: a context in which reading a tensor's values on the host from Python raises.

On a GPU each such read (.item(), .tolist(), .cpu(), bool()/int()/float() of a tensor, .nonzero(), ...)
waits for the device; code that must run sync-free (a speculative round's draft and verify bodies) is run
inside this context on the CPU, where the same reads are silent, to prove it makes none.
"""
import contextlib

import torch

_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
            "__array__", "argwhere")
_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique")


class HostRead(RuntimeError):
    pass


def _raiser(name):
    def fail(*args, **kwargs):
        raise HostRead(f"host read inside a sync-free region: {name}")
    return fail


@contextlib.contextmanager
def no_host_reads():
    saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in _METHODS if hasattr(torch.Tensor, n)]
    saved += [(torch, n, getattr(torch, n)) for n in _FUNCTIONS]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, _raiser(f"{'Tensor.' if owner is torch.Tensor else 'torch.'}{name}"))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
