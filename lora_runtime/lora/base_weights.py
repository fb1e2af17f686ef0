"""Read-only views of the served model's device weights, for what adapter loading derives
from them (DoRA's norms) or checks against them (base weights PEFT saves with embed/head
adapters). The weights never change after load, so fetch threads may read them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lora_runtime.lora.adapter import EMBED, HEAD


class BaseWeights:
    """Read-only views of the served model's device weights that adapter loading needs."""

    def __init__(self, model):
        self._model = model

    @property
    def config(self):
        """The served model's ModelConfig."""
        return self._model.config

    def kernel(self, layer: int, module: str) -> tuple[jax.Array, bool]:
        """A module's base weight and whether it is stored [out, in] (the tied head), else [in, out]."""
        m = self._model
        if module == HEAD:
            if m.lm_head is None:
                return m.embed_tokens.embedding[...], True
            return m.lm_head.kernel[...], False
        if module == EMBED:
            return m.embed_tokens.embedding[...], False
        return self._model.linear(layer, module)[0], False

    def bias(self, layer: int, module: str) -> jax.Array | None:
        if module in (HEAD, EMBED):
            return None
        return self._model.linear(layer, module)[1]


@jax.jit
def _equal(base, saved):
    """Whether two weights hold the same values at the lower of their two precisions."""
    low = base.dtype if jnp.finfo(base.dtype).bits <= jnp.finfo(saved.dtype).bits else saved.dtype
    return jnp.array_equal(base.astype(low), saved.astype(low))


def same_weights(base: BaseWeights, module: str, saved: np.ndarray) -> bool:
    """Whether `saved` (HF layout, [vocab, hidden]) equals the served model's embed_tokens or lm_head."""
    kernel, out_in = base.kernel(-1, module)
    hf = kernel if module == EMBED or out_in else kernel.T  # lm_head kernel is [hidden, vocab]
    if hf.shape != saved.shape:
        return False
    return bool(_equal(hf, saved))
