"""Token embeddings whose table is stored quantized (``quanta build --quantize-embedding``).

A lookup dequantizes the rows it reads. On a tied model the head's quantized product holds
the same table (packed for its kernel), and the lookup reads its rows from there
(``QuantizedLinear.rows``), so the table is in memory once; the module docstring of
``quanta.build.quantization`` says what a build stores.
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.runner.quantized import ROW_KERNELS, QuantizedLinear, QuantizedWeight


class QuantizedEmbedding(nn.Module):
    """A token embedding whose table is stored quantized (``--quantize-embedding``): a lookup
    dequantizes the rows it reads. Where a tied head holds the same table, the rows come
    from the head's packed weight (``QuantizedLinear.rows``), so the table is in memory once;
    otherwise the embedding keeps the codes as stored and dequantizes from them."""

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, head: QuantizedLinear | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.mode, self.dtype = weight.mode, dtype
        shared = head if head is not None and head.kernel in ROW_KERNELS else None
        # Not a submodule (nn.Module would register it): the head is the model's, and its
        # buffers are the model's once.
        self.__dict__["_head"] = shared
        self.shared = shared is not None
        if not self.shared:
            self.register_buffer("qweight", weight.qweight)
            self.register_buffer("scales", weight.scales)
            self.register_buffer("zeros", weight.zeros)

    _head: QuantizedLinear | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self._head is not None:
            rows = self._head.rows(flat)
            assert rows is not None
        else:
            zeros = None if self.zeros is None else self.zeros[flat]
            picked = QuantizedWeight(self.mode, self.qweight[flat], self.scales[flat], zeros)
            rows = picked.dequantize(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        table = "the head's table" if self.shared else "its own table"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.mode}, {table}"


def quantize_embeddings(model: nn.Module, products: dict[int, nn.Module]) -> int:
    """Replace every ``nn.Embedding`` the loader gave a quantized table with a
    ``QuantizedEmbedding``, reading a head's rows where ``products`` (``id`` of a
    ``QuantizedWeight`` -> the product built from it) holds the same table; returns how
    many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "quantized", None)
            if isinstance(child, nn.Embedding) and weight is not None:
                head = products.get(id(weight))
                head = head if isinstance(head, QuantizedLinear) else None
                setattr(parent, name, QuantizedEmbedding(weight, child.weight.dtype, head))
                replaced += 1
    return replaced
