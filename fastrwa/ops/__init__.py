"""The weighted scan below the public functions: the custom op and its autograd
(:mod:`.autograd`), the backend contract (:mod:`.contract`), the registry that picks a
backend (:mod:`.registry`), the backends themselves (:mod:`.backends`), and the shared
vocabulary (:mod:`.vocab`). docs/architecture.md describes the layers."""
