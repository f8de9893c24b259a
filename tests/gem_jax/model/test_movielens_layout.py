"""The MovieLens instance of the feature schema computes what the fixed MovieLens layout did.

`golden/movielens_tiny_logits.npz` was recorded with the earlier fixed layout (user
`[B, 4]` columns user/age/gender/occupation, genres as a float multi-hot `[B, G]`, two
tasks) on `configs/movielens_tiny.py`: the first three train batches of ml-latest-small,
the logits of a fresh `GEMModel` (`nnx.Rngs(0)`, jitted) on the first, and the losses of three
train steps from `setup_training`. The schema keeps every table's shape, the parameter
init order and the pooling, so the same data set builds the same batches (asserted bit for bit: integer ids and 0/1
labels) and the model computes the same logits and losses. Those were recorded on one CPU
(jax 0.11.2, the suite's settings: `tests/conftest.py`) and match it there bit for bit; on
another CPU float32 sums may run in another order, so they are checked against a bound
derived from float32 summation (`LAYOUT_BOUND`), far below what a wrong feature, table or
pooling would change.
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import gem_jax
from gem_jax.batch import Pooling
from gem_jax.model.gem import GEMModel
from tolerances import check, rel_err, sum_worst

GOLDEN = np.load(Path(__file__).parent / "golden" / "movielens_tiny_logits.npz")


@pytest.fixture(scope="module")
def training():
    config = gem_jax.load_config("configs/movielens_tiny.py")
    return gem_jax.setup_training(config)


def test_the_movielens_spec_keeps_the_fixed_layouts_features(training):
    spec = training[0].dataset.spec
    assert spec.tasks == ("like", "love")
    assert [(f.name, f.vocab_size, f.max_values) for f in spec.user_features] == [
        ("user", 611, 1), ("age", 1, 1), ("gender", 1, 1), ("occupation", 1, 1)
    ]
    genres = spec.item_features[0]
    assert (genres.name, genres.vocab_size, genres.pooling) == ("genres", GOLDEN["candidate_genres"].shape[1] + 1, Pooling.MULTI_HOT)


def test_the_first_batch_holds_the_fixed_layouts_values(training):
    batch = next(training[0].dataset.train_iterator())
    np.testing.assert_array_equal(batch.history.values, GOLDEN["history_values"])
    np.testing.assert_array_equal(batch.history.offsets, GOLDEN["history_offsets"])
    user = np.stack([batch.user[name][:, 0] for name in ("user", "age", "gender", "occupation")], axis=1)
    np.testing.assert_array_equal(user, GOLDEN["user"])
    np.testing.assert_array_equal(batch.candidate_item, GOLDEN["candidate_item"])
    genres = batch.candidate_features["genres"]
    hot = np.zeros_like(GOLDEN["candidate_genres"])
    for row, ids in enumerate(genres):
        hot[row, ids[ids > 0] - 1] = 1.0
    np.testing.assert_array_equal(hot, GOLDEN["candidate_genres"])
    np.testing.assert_array_equal(batch.labels, GOLDEN["labels"])
    np.testing.assert_array_equal(batch.weights, GOLDEN["weights"])


# Two summation orders of a K-term float32 sum differ by at most gamma_K of the sum of magnitudes
# (tolerances.sum_worst; K <= 1024 covers every contraction of the tiny model: d = 8, B = 64, 16
# events), and the forward chains about 16 such reductions between normalisations: 16 gamma_1024
# = 9.8e-4 relative. A wrong layout (a table, a feature or a pooling swapped) moves logits by O(1).
LAYOUT_BOUND = 16 * sum_worst(1024)


def test_logits_and_train_losses_match_the_fixed_layout(training):
    training, state = training
    it = training.dataset.train_iterator()
    batches = [next(it) for _ in range(3)]
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GEMModel(training.dataset.spec, training.config.model, rngs=nnx.Rngs(0)))
    logits = np.asarray(jax.jit(lambda p, batch: nnx.merge(graphdef, p)(batch))(params, batches[0]))
    check("logits against the fixed layout's", rel_err(logits, GOLDEN["logits"]), LAYOUT_BOUND)
    losses = []
    for batch in batches:
        state, metrics = training.train_step(state, training.placement.put(batch))
        losses.append(float(metrics["loss"]))
    check("three train losses against the fixed layout's", rel_err(losses, GOLDEN["train_losses"]), LAYOUT_BOUND)
