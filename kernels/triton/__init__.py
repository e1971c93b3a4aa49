"""The Triton kernels of the weighted scan: ``scan_fwd`` (forward), ``scan_bwd`` (backward),
``step`` (one streaming step), on the device functions of ``common`` (the math) and
``sequence`` (which sequence and chunk a program covers). Launched by
``fastrwa/ops/triton_host.py``; docs/kernels.md describes them.
"""
