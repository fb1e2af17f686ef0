"""Every activation a checkpoint's hidden_act may name computes what transformers' ACT2FN does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.activations import ACT2FN

from lora_runtime.model.activations import ACTIVATIONS, activation


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_transformers(name):
    x = np.linspace(-12.0, 12.0, 2001, dtype=np.float32)
    ours = np.asarray(activation(name)(x))
    with torch.no_grad():
        theirs = ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=2e-6)


def test_an_unknown_name_lists_the_supported_ones():
    with pytest.raises(KeyError, match="'laplace'.*gelu_pytorch_tanh"):
        activation("laplace")
