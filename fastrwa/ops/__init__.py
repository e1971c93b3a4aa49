"""The weighted scan below the public functions: the custom ops and their autograd
(:mod:`.autograd`), which backend runs and what a backend takes and returns
(:mod:`.dispatch`), the backends' host code (:mod:`.numba_host`, :mod:`.triton_host`,
:mod:`.torch_host` with :mod:`.chunked` and :mod:`.transforms`) and output allocation
(:mod:`.buffers`). The device code is in ``kernels/`` (``fastrwa.kernels``).
docs/architecture.md describes the layers."""
