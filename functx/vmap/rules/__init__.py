"""Batching rules, one module per op family. Importing this package fills `VMAP_RULES`."""

from . import (  # noqa: F401
    autograd_meta,
    custom_ops,
    data_dependent,
    factory,
    indexing,
    linalg,
    nn_conv,
    nn_losses,
    nn_misc,
    nn_norm,
    nn_pooling,
    nn_rnn,
    pointwise,
    random,
    reductions,
    views,
    whole_calls,
)
