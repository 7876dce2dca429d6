"""Built-in models: output shapes, causality, and that each learns its dataset quickly."""

import pytest
import torch
import torch.nn.functional as F

from dlpipe.data.sequences import TokenSequenceDataset
from dlpipe.data.tabular import TabularDataset
from dlpipe.data.vision import SyntheticJPEGDataset
from dlpipe.loader.split import train_val_split
from dlpipe.models.cnn import SmallCNN
from dlpipe.models.mlp import MLP
from dlpipe.models.transformer import TinyTransformer


@pytest.mark.parametrize("hw", [(16, 16), (56, 56), (17, 40)])
def test_cnn_output_shape_for_any_input_size(hw):
    model = SmallCNN(num_classes=7, width=8)
    assert model(torch.randn(2, 3, *hw)).shape == (2, 7)
    assert SmallCNN(num_classes=3, in_channels=1, width=4)(torch.randn(1, 1, *hw)).shape == (1, 3)


def test_mlp_output_shape_and_no_batch_statistics():
    model = MLP(in_features=5, num_classes=3, hidden=16, depth=3)
    x = torch.randn(6, 5)
    assert model(x).shape == (6, 3)
    # No normalisation layers: a sample's output is the same alone or in a batch, in train mode too.
    assert torch.allclose(model(x)[2:3], model(x[2:3]), atol=1e-6)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert MLP(in_features=5, num_classes=3, depth=0)(x).shape == (6, 3)


def test_transformer_output_shape():
    model = TinyTransformer(vocab_size=50, seq_len=12, d_model=16, n_heads=2, n_layers=1)
    tokens = torch.randint(0, 50, (3, 12))
    assert model(tokens).shape == (3, 12, 50)
    assert model(tokens[:, :5]).shape == (3, 5, 50)  # shorter sequences are fine
    with pytest.raises(ValueError, match="model.seq_len=12"):
        model(torch.randint(0, 50, (1, 13)))


def test_transformer_is_causal():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=30, seq_len=10, d_model=16, n_heads=4, n_layers=2).eval()
    tokens = torch.randint(0, 30, (2, 10))
    changed = tokens.clone()
    t = 4
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 30
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, : t + 1], after[:, : t + 1], atol=1e-5)
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :], atol=1e-3)  # later positions do see it


def test_transformer_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"model\.d_model=30.*model\.n_heads=4"):
        TinyTransformer(d_model=30, n_heads=4)


def train(model, inputs, targets, steps, lr, batch=128, flatten=False):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(inputs), (batch,))
        logits = model(inputs[idx])
        loss = F.cross_entropy(logits.flatten(0, 1) if flatten else logits,
                               targets[idx].flatten() if flatten else targets[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_mlp_learns_tabular_well_above_chance():
    torch.manual_seed(0)
    # noise=2 makes classes overlap, so this is not solved by the first step.
    ds = TabularDataset(size=4096, num_features=32, num_classes=4, noise=2.0)
    train_set, val_set = train_val_split(ds, 0.25, seed=0)
    x, y = ds.features, ds.labels
    model = MLP(in_features=32, num_classes=4, hidden=64)
    model.eval()
    with torch.no_grad():
        before = (model(x[val_set.indices]).argmax(1) == y[val_set.indices]).float().mean().item()
    train(model, x[train_set.indices], y[train_set.indices], steps=300, lr=3e-3)
    model.eval()
    with torch.no_grad():
        acc = (model(x[val_set.indices]).argmax(1) == y[val_set.indices]).float().mean().item()
    assert before < 0.5 and acc > 0.85  # chance is 0.25


def test_cnn_learns_synthetic_jpeg_classes():
    torch.manual_seed(0)
    kwargs = {"image_size": 32, "crop_size": 28, "num_classes": 4}
    ds = SyntheticJPEGDataset(size=256, augment=True, **kwargs)
    val = SyntheticJPEGDataset(size=128, augment=False, seed=1, **kwargs)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    xv = torch.stack([val[i][0] for i in range(len(val))])
    model = SmallCNN(num_classes=4, width=8)
    train(model, x, torch.tensor(ds.labels), steps=25, lr=1e-2, batch=64)
    model.eval()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == torch.tensor(val.labels)).float().mean().item()
    assert acc > 0.8


def test_transformer_learns_markov_sequences():
    torch.manual_seed(0)
    ds = TokenSequenceDataset(size=512, seq_len=32, vocab_size=32)
    model = TinyTransformer(vocab_size=32, seq_len=32, d_model=32, n_heads=2, n_layers=1)
    loss = train(model, ds.tokens[:, :-1], ds.tokens[:, 1:], steps=60, lr=3e-3, batch=64, flatten=True)
    # Uniform guessing costs ln(32) = 3.47 nats; each token has at most 4 successors (<= 1.39 nats).
    assert loss < 2.0
