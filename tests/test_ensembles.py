"""Ensemble evaluation: identical members, a hand-computed two-member case, scalar binary outputs,
and refusing members of different architectures or class counts."""
import numpy as np
import pytest
import torch

from convbias.evaluation.ensembles import check_same_architecture, error_rate, evaluate_ensemble


@pytest.mark.parametrize("average", ["logits", "probabilities"])
def test_ensemble_of_identical_members_is_that_member(average):
    torch.manual_seed(0)
    logits, labels = torch.randn(50, 4), torch.randint(0, 4, (50,))
    result = evaluate_ensemble(logits.expand(3, -1, -1), labels, average)
    single = error_rate(logits, labels)
    assert result.members == 3 and result.member_errors == [single] * 3
    assert result.ensemble_error == result.mean_member_error == single
    assert result.fluctuation == pytest.approx(0.0, abs=1e-12)  # (x + x + x) / 3 may round


def test_two_members_against_a_direct_computation():
    a = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0]])
    b = np.array([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0], [1.0, 0.0]])
    labels = np.array([0, 1, 0, 1])
    result = evaluate_ensemble(torch.tensor(np.stack([a, b])), torch.tensor(labels))
    mean = (a + b) / 2  # predicts 0, 1, 1, 1
    assert result.member_errors == [0.0, 75.0]
    assert result.ensemble_error == 100.0 * np.mean(mean.argmax(1) != labels) == 25.0
    fluctuation = np.sqrt(np.mean([((m - mean) ** 2).sum(1) for m in (a, b)]))
    assert result.fluctuation == pytest.approx(fluctuation)

    probs = torch.tensor(np.stack([a, b])).softmax(-1)
    by_probs = evaluate_ensemble(torch.tensor(np.stack([a, b])), torch.tensor(labels), "probabilities")
    assert by_probs.ensemble_error == error_rate(probs.mean(0), torch.tensor(labels))
    assert by_probs.fluctuation == pytest.approx((probs - probs.mean(0)).square().sum(-1).mean().sqrt().item())


def test_scalar_outputs_of_a_binary_classifier():
    outputs = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, -1.5]])
    labels = torch.tensor([1.0, -1.0, 1.0])
    result = evaluate_ensemble(outputs, labels)
    assert result.member_errors == pytest.approx([0.0, 200 / 3])
    assert result.ensemble_error == pytest.approx(100 / 3)  # mean output: 2, -0.5, -0.5
    assert result.fluctuation == pytest.approx(np.sqrt(np.mean([1, 2.25, 1] * 2)))
    with pytest.raises(ValueError, match="probabilities.*scalar"):
        evaluate_ensemble(outputs, labels, "probabilities")


def test_members_of_different_architectures_or_classes_are_refused():
    base = {"model": "convit_tiny", "num_classes": 10, "img_size": 8}
    check_same_architecture([base, dict(base)], ["a", "b"])
    with pytest.raises(ValueError, match=r"runs/c differs from runs/a in num_classes: 10 vs 5"):
        check_same_architecture([base, dict(base), {**base, "num_classes": 5}], ["runs/a", "runs/b", "runs/c"])
    with pytest.raises(ValueError, match=r"in model: 'convit_tiny' vs 'deit_tiny'"):
        check_same_architecture([base, {**base, "model": "deit_tiny"}], ["a", "b"])
    with pytest.raises(ValueError, match="at least 2 members"):
        check_same_architecture([base], ["a"])
