"""What the Trainer says once, at its first batch: a warning when a token-level target equals its input
(unshifted labels), and that torch.compile is compiling. Driven with the built-in token dataset and
causal transformer, as tests/test_runner.py drives the loop."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from dlpipe.data.sequences import TokenSequenceDataset
from dlpipe.loader.collate import PadSequences
from dlpipe.models.transformer import TinyTransformer
from dlpipe.schema import TrainerConfig
from dlpipe.training.first_step import FirstStep, unshifted_labels
from dlpipe.training.losses import CrossEntropy, ModelLoss
from dlpipe.training.objective import Objective
from dlpipe.training.runner import Trainer

SEQ, VOCAB = 16, 16


def tokens(**kwargs) -> TokenSequenceDataset:
    return TokenSequenceDataset(size=32, seq_len=SEQ, vocab_size=VOCAB, **kwargs)


def train(loader, objective: Objective, epochs: int = 2) -> list[dict]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_heads=2, n_layers=1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainerConfig(epochs=epochs, progress=False), objective=objective)
    return trainer.fit(loader)


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_targets_equal_to_the_inputs_are_warned_about_once(caplog):
    """input_ids as the target too: what a causal LM given unshifted labels trains on."""
    loader = DataLoader(tokens(as_dict=True), batch_size=8)
    train(loader, Objective(CrossEntropy(), "input_ids", "input_ids"))
    assert warnings_in(caplog) == [
        "the first batch's targets equal its inputs ([8, 16] token ids): a causal LM trained so learns to copy its "
        "input (validation accuracy near 1.0 after one epoch, and nothing learnt); if these are next-token labels, "
        "shift them by one (target[t] = input[t + 1]), or use loss=model with a model that shifts its labels itself"]


def test_shifted_labels_train_without_a_warning(caplog):
    train(DataLoader(tokens(), batch_size=8), Objective(CrossEntropy()))
    train(DataLoader(tokens(as_dict=True), batch_size=8), Objective(CrossEntropy(), "input_ids", "labels"))
    assert warnings_in(caplog) == []


def test_padded_unshifted_labels_are_found_past_the_padding():
    """Ragged items padded per batch (loader=padded): inputs with 0, targets with -100, which the loss ignores."""
    items = [tokens(min_seq_len=4)[i] for i in range(8)]
    unshifted = PadSequences()([(x, x) for x, _ in items])
    assert (unshifted[1] == -100).any() and not torch.equal(unshifted[0], unshifted[1])  # padding differs
    assert unshifted_labels(Objective(CrossEntropy()), unshifted) is not None
    assert unshifted_labels(Objective(CrossEntropy()), PadSequences()(items)) is None


@pytest.mark.parametrize("objective", [Objective(ModelLoss(), None, "labels"),  # the model shifts itself
                                       Objective(torch.nn.MSELoss())])  # float: an autoencoder, not tokens
def test_models_that_shift_themselves_and_float_targets_are_left_alone(objective):
    x = torch.randint(0, VOCAB, (4, SEQ))
    batch = {"input_ids": x, "labels": x} if objective.kind == "model" else (x.float(), x.float())
    assert unshifted_labels(objective, batch) is None


def test_a_compiled_model_says_so_before_its_first_step_and_how_long_it_took(caplog):
    """(The compiling itself runs in tests/test_tasks_cli.py, where the two lines are read from a real run.)"""
    caplog.set_level(logging.INFO, logger="dlpipe")
    first = FirstStep(compiled=True)
    x = torch.randint(0, VOCAB, (4, SEQ))
    for _ in range(3):
        first.before(Objective(), (x, x.roll(-1, dims=1)))
        first.after()
    assert caplog.messages[0] == "compiling the model with torch.compile (first steps are slow)"
    assert caplog.messages[1].startswith("first compiled step (forward and backward) took ")
    assert len(caplog.messages) == 2
