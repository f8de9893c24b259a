"""`Source.EVENTS`: a converted CSV + Parquet log with string ids trains as its events: every event is once an
example of its split, with its labels, weight, candidate item and features, after exactly the user's earlier
events; the data set's identity follows the conversion."""

import collections
import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

from event_logs import CATEGORY, COUNTRY, EARLY, LATE, SCHEMA, TAGS, convert_event_log, write_event_log
from gem_jax.batch import HistoryField, Pooling
from gem_jax.data.ingest.schema import LabelRule
from gem_jax.data.ingest.shards import ConvertedLog
from gem_jax.data.config import DataConfigError
from gem_jax.data.pipeline import DataConfig, Source, load_dataset
from gem_jax.data.rows import DataFormatError
from gem_jax.data.sources.converted import converted_fingerprint

MAX_SEQ_LEN, TIME_BUCKETS, B = 4, 6, 16
QUANTILE = 0.7


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The log (80 events before time 50, 40 after) converted with a time-quantile split; (directory, rows, manifest)."""
    root = tmp_path_factory.mktemp("own")
    rows = write_event_log(root / "events", num_train=80, num_eval=40)
    result = convert_event_log(root / "events", root / "mylog", split=f"time:{QUANTILE}")
    return result.out, rows, result.manifest


def config(path, **changes) -> DataConfig:
    return DataConfig(source=Source.EVENTS, path=str(path), max_seq_len=MAX_SEQ_LEN, num_time_buckets=TIME_BUCKETS, batch_size=B, prefetch_batches=0, **changes)


@pytest.fixture(scope="module")
def dataset(converted):
    return load_dataset(config(converted[0]))


def bucket(age: int) -> int:
    """Reference time bucket: 1 + min(floor(log2(1 + age)), TIME_BUCKETS - 2)."""
    return 1 + min((1 + age).bit_length() - 1, TIME_BUCKETS - 2)


def expected_examples(rows, cutoff) -> dict[str, collections.Counter]:
    """Per split, one entry per event: user, country, item, category, tags, labels, weight, then its history
    (item, action, time bucket of each of the user's earlier events, oldest first, the last MAX_SEQ_LEN)."""
    by_user = collections.defaultdict(list)
    for row in rows:  # input order; sorted() below is stable, so ties keep it
        by_user[row["uid"]].append(row)
    out = {"train": collections.Counter(), "eval": collections.Counter()}
    for user, events in by_user.items():
        events = sorted(events, key=lambda r: r["ts"])
        for j, e in enumerate(events):
            split = "eval" if e["ts"] >= cutoff else "train"
            history = tuple((h["iid"], h["act"], bucket(e["ts"] - h["ts"])) for h in events[max(0, j - MAX_SEQ_LEN) : j])
            weight = float(np.float32(e["w"])) if split == "train" else 1.0
            tags = tuple(sorted(filter(None, TAGS[e["iid"]].split("|"))))
            labels = (float(e["click"]), float(e["rating"] >= 4))
            out[split][(user, COUNTRY[user], e["iid"], CATEGORY[e["iid"]], tags, labels, weight, history)] += 1
    return out


def seen_examples(batches, reader) -> collections.Counter:
    """The real examples of `batches` in `expected_examples`' form, decoded through the vocabularies."""
    names = {name: [None, None] + reader.vocab(name).ids.to_pylist() for name in reader.manifest["vocabularies"]}
    names["action"][0] = ""  # an empty action is row 0
    seen = collections.Counter()
    for batch in batches:
        offsets, values = np.asarray(batch.history.offsets), np.asarray(batch.history.values)
        for i in np.flatnonzero(batch.weights > 0):
            history = tuple(
                (names["item"][item], names["action"][action], int(age))
                for item, action, age in values[offsets[i] : offsets[i + 1]][:, [HistoryField.ITEM, HistoryField.ACTION, HistoryField.TIME_BUCKET]]
            )
            tags = tuple(sorted(names["item_feature.tags"][t] for t in batch.candidate_features["tags"][i] if t))
            key = (
                names["user"][batch.user["user"][i, 0]],
                names["user_feature.country"][batch.user["country"][i, 0]],
                names["item"][batch.candidate_item[i]],
                names["item_feature.category"][batch.candidate_features["category"][i, 0]],
                tags,
                tuple(float(x) for x in batch.labels[i]),
                float(batch.weights[i]),
                history,
            )
            seen[key] += 1
    return seen


def test_every_event_is_once_an_example_of_its_split(converted, dataset):
    out, rows, manifest = converted
    cutoff = manifest["split"]["cutoff"]
    assert cutoff == sorted(r["ts"] for r in rows)[int(QUANTILE * len(rows))]  # the exact quantile
    expected = expected_examples(rows, cutoff)
    reader = ConvertedLog(out)
    train = seen_examples(dataset.train_iterator(num_epochs=1), reader)
    evals = seen_examples(dataset.eval_batches(), reader)
    assert sum(train.values()) == dataset.info.num_train_examples == manifest["counts"]["train_events"]
    assert sum(evals.values()) == dataset.info.num_eval_examples == manifest["counts"]["eval_events"]
    assert train == expected["train"]
    assert evals == expected["eval"]
    # Users without earlier events: the early bird's only event (train), the night owl's first (eval).
    assert any(key[0] == EARLY and key[-1] == () for key in train)
    owl = sorted((len(key[-1]) for key in evals if key[0] == LATE))
    assert owl == [0, 1, 2]  # its eval events see the earlier eval events


def test_spec_and_info_follow_the_conversion(converted, dataset):
    out, rows, manifest = converted
    spec, info = dataset.spec, dataset.info
    vocab = {name: v["rows"] for name, v in manifest["vocabularies"].items()}
    assert spec.tasks == ("click", "like") and info.label_names == ("click", "rating>=4")
    assert spec.num_items == vocab["item"] and spec.num_actions == vocab["action"] and spec.max_seq_len == MAX_SEQ_LEN
    assert [(f.name, f.vocab_size, f.max_values) for f in spec.user_features] == [("user", vocab["user"], 1), ("country", vocab["user_feature.country"], 1)]
    assert [(f.name, f.vocab_size, f.max_values) for f in spec.item_features] == [("category", vocab["item_feature.category"], 1), ("tags", vocab["item_feature.tags"], 2)]
    assert all(f.pooling is Pooling.MEAN for f in spec.user_features + spec.item_features)
    assert (info.num_events, info.num_users, info.num_items) == (len(rows), len({r["uid"] for r in rows}), len({r["iid"] for r in rows}))
    eval_rows = [r for r in rows if r["ts"] >= manifest["split"]["cutoff"]]
    np.testing.assert_allclose(info.eval_positive_rate, [np.mean([r["click"] for r in eval_rows]), np.mean([r["rating"] >= 4 for r in eval_rows])], rtol=1e-6)
    assert info.source == "EVENTS" and info.path == str(out.resolve()) and info.name == "mylog"
    assert info.fingerprint == converted_fingerprint(manifest)
    summary = info.summary()
    assert "split time quantile 0.7" in summary and "weight column 'w': each train example's loss weight" in summary
    # The item-mean baseline: each item's mean train label.
    item_ids = ConvertedLog(out).vocab("item").ids.to_pylist()
    for row in range(2, spec.num_items):
        labels = [r["click"] for r in rows if r["iid"] == item_ids[row - 2] and r["ts"] < manifest["split"]["cutoff"]]
        if labels:
            assert dataset.item_mean_label(0)[row] == pytest.approx(np.mean(labels))


def test_the_fingerprint_is_the_data_not_the_place(converted, tmp_path):
    """The same inputs converted elsewhere: the same fingerprint; a changed input, converted again: another."""
    out, rows, manifest = converted
    events = out.parent / "events"
    again = convert_event_log(events, tmp_path / "elsewhere", split=f"time:{QUANTILE}")
    assert converted_fingerprint(again.manifest) == converted_fingerprint(manifest)
    version_1 = {key: value for key, value in manifest.items() if key not in ("train_events", "item_train_labels")} | {"version": 1}
    assert converted_fingerprint(version_1) == converted_fingerprint(manifest)  # the index files are derived: same data
    uncounted = {key: value for key, value in manifest.items() if key != "first_duplicate_event"}
    uncounted["counts"] = {key: value for key, value in manifest["counts"].items() if key != "duplicate_events"}
    assert converted_fingerprint(uncounted) == converted_fingerprint(manifest)  # written before duplicates were counted: same data
    changed = tmp_path / "changed"
    write_event_log(changed, num_train=80, num_eval=40, seed=1)
    other = convert_event_log(changed, tmp_path / "other", split=f"time:{QUANTILE}")
    assert converted_fingerprint(other.manifest) != converted_fingerprint(manifest)


def test_duplicate_events_are_noted_and_a_conversion_before_their_count_loads(tmp_path):
    """Rows repeating an earlier row are a line of the data set summary; a conversion written before they were
    counted loads, says they were not counted (rather than none) and keeps its fingerprint."""
    write_event_log(tmp_path / "events", num_train=30, num_eval=10)
    lines = (tmp_path / "events" / "a.csv").read_text().splitlines()
    (tmp_path / "events" / "a.csv").write_text("\n".join(lines + lines[1:3]) + "\n")
    out = convert_event_log(tmp_path / "events", tmp_path / "mylog").out
    note = "2 event(s) equal to an earlier row in every column read, as parsed (times to the second); kept, each an example"
    counted = load_dataset(config(out)).info
    assert note in counted.notes and counted.num_events == 42
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["counts"]["duplicate_events"], manifest["first_duplicate_event"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    uncounted = load_dataset(config(out)).info
    assert not any("equal to an earlier row" in line for line in uncounted.notes) and uncounted.fingerprint == counted.fingerprint
    assert "duplicate events not counted (converted by an earlier gem-data; convert again into a new --out to count them)" in uncounted.notes


def test_weights_are_optional_and_eval_weighs_one(tmp_path):
    """Without a weight column every real example weighs 1."""
    rows = write_event_log(tmp_path / "events", num_train=30, num_eval=10)
    schema = dataclasses.replace(SCHEMA, weight=None, action=None)
    convert_event_log(tmp_path / "events", tmp_path / "plain", schema=schema)
    dataset = load_dataset(config(tmp_path / "plain"))
    assert dataset.spec.num_actions == 2  # PAD and the one implicit action
    batches = list(dataset.train_iterator(num_epochs=1))
    weights = np.concatenate([b.weights for b in batches])
    assert np.count_nonzero(weights) == 30 and set(weights[weights > 0].tolist()) == {1.0}
    assert all(set(np.asarray(b.history.values)[:, HistoryField.ACTION].tolist()) <= {1} for b in batches)
    assert not any("weight column" in note for note in dataset.info.notes) and len(rows) == 40


def test_bad_settings_and_directories_are_refused(converted, tmp_path):
    out = converted[0]
    with pytest.raises(DataConfigError, match="set DataConfig.path to that directory"):
        load_dataset(dataclasses.replace(config(out), path=None))
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_dataset(config(tmp_path / "missing"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataFormatError, match="no manifest.json; not a converted log"):
        load_dataset(config(tmp_path / "plain"))
    events = out.parent / "events"
    with pytest.raises(ValueError, match=r"left 120 train and 0 eval events; both must be > 0 \(convert again with another --split\)"):
        load_dataset(config(convert_event_log(events, tmp_path / "late", split="time:1000").out))
    swapped = convert_event_log(events, tmp_path / "swapped", split=f"time:{QUANTILE}").out
    write_event_log(tmp_path / "more", num_train=90, num_eval=40, seed=3)
    donor = convert_event_log(tmp_path / "more", tmp_path / "donor", split=f"time:{QUANTILE}").out
    shard = sorted((swapped / "shards").iterdir())[0]
    shard.write_bytes((donor / "shards" / shard.name).read_bytes())  # a shard of another conversion
    with pytest.raises(DataFormatError, match=r"record shards/part-00000-of-00003.array_record:\d+ holds \d+ events, the index \d+; the shards were changed after the conversion"):
        list(load_dataset(config(swapped)).train_iterator(num_epochs=1))  # found when the record is read
    unnamed = dataclasses.replace(SCHEMA, labels=(LabelRule(name="rating>=4", column="rating", op=">=", threshold=4.0),))  # as older gem-data wrote
    with pytest.raises(ValueError, match=r"names do not fit the model: task name 'rating>=4' must be letters"):
        load_dataset(config(convert_event_log(events, tmp_path / "unnamed", schema=unnamed).out))


def test_history_rows_carry_their_items_features(converted):
    """With `history_item_features` every history row holds its own item's features (category, then the
    two tags columns) after the three HistoryField columns; without it the values are the three columns."""
    out, rows, _ = converted
    names = {name: [None, None] + ConvertedLog(out).vocab(name).ids.to_pylist() for name in ("item", "item_feature.category", "item_feature.tags")}
    dataset = load_dataset(config(out, history_item_features=True))
    spec = dataset.spec
    assert spec.history_item_features and spec.history_feature_columns == {"category": slice(3, 4), "tags": slice(4, 6)}
    checked = 0
    for batch in dataset.eval_batches():
        values = np.asarray(batch.history.values)[: int(batch.history.offsets[-1])]
        assert values.shape[1] == spec.history_width == 6
        for item, category, *tags in values[:, [HistoryField.ITEM, 3, 4, 5]]:
            iid = names["item"][item]
            assert names["item_feature.category"][category] == CATEGORY[iid]
            assert sorted(names["item_feature.tags"][t] for t in tags if t) == sorted(filter(None, TAGS[iid].split("|")))
            checked += 1
    assert checked > 50
    assert load_dataset(config(out)).spec.history_width == 3
    note = "history rows carry each event's item features: category, tags (data.history_item_features)"
    assert note in dataset.info.summary() and note not in load_dataset(config(out)).info.summary()


def test_history_item_features_without_item_features_are_refused(converted, tmp_path):
    """A log converted without item features has none for the history rows to carry: the setting is refused
    with what to change, not ignored; without the setting the same log trains."""
    events = converted[0].parent / "events"
    plain = convert_event_log(events, tmp_path / "plain", schema=dataclasses.replace(SCHEMA, features=tuple(f for f in SCHEMA.features if f.name == "country"))).out
    with pytest.raises(DataConfigError, match=re.escape(f"{plain}: data.history_item_features is set, but the data set has no item features")) as error:
        load_dataset(config(plain, history_item_features=True))
    assert str(error.value).startswith(f"{plain}: ") and str(error.value).endswith("--item-feature")  # the path given, not its last part
    assert load_dataset(config(plain)).spec.item_features == ()


def test_a_shard_damaged_after_conversion_is_named(converted, tmp_path):
    copy = tmp_path / "mylog"
    shutil.copytree(converted[0], copy)
    log = ConvertedLog(copy)
    shard = log.files[0]
    data = bytearray(shard.read_bytes())
    data[200:216] = bytes(b ^ 0x5A for b in data[200:216])  # inside the first chunk's records (a file is padded to 128 KiB)
    shard.write_bytes(bytes(data))
    fresh = ConvertedLog(copy)
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(shard))}: the shard file cannot be read \(.+\): a shard was damaged after conversion; convert the log again"):
        fresh.record_reader().read(np.arange(len(fresh)))
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(copy))}: records 0\.\.{len(fresh) - 1} of this share, in its shard files, cannot be read"):
        fresh.read_all()
