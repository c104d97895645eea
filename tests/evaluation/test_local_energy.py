"""The local-energy curve (convbias.evaluation.landscape.local_energy) against a closed form."""

import math

import pytest
import torch
from torch import nn

from convbias.evaluation.landscape import Batches, local_energy

pytestmark = pytest.mark.usefixtures("single_thread")


def test_local_energy_of_a_one_weight_classifier_matches_its_closed_form():
    # logits (w x, 0 x) with w = 1 and x > 0 classify every point as class 0; the noisy w (1 + sigma eps)
    # flips every prediction iff eps < -1/sigma (the zero weight stays zero), so the mean error is
    # 100 Phi(-1/sigma), Phi the normal CDF.
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0], [0.0]]))
    x = torch.linspace(0.1, 1.0, 20)[:, None]
    data = Batches(x, torch.zeros(20, dtype=torch.long), batch_size=20)
    curve = local_energy(model, data, [0.0, 0.5, 1.0, 2.0], draws=3000)
    assert curve[0] == (0.0, 0.0, 0.0)
    for sigma, mean, _ in curve[1:]:
        expected = 100 * 0.5 * math.erfc(1 / sigma / math.sqrt(2))
        assert mean == pytest.approx(expected, abs=3 * math.sqrt(expected * (100 - expected) / 3000))
    with pytest.raises(ValueError, match="sigmas >= 0"):
        local_energy(model, data, [-0.1])
