"""gem-data convert: a mixed CSV + Parquet log with string ids round-trips to per-user records."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from gem_jax.data.ingest import convert as convert_module
from gem_jax.data.ingest import shard_writer
from gem_jax.data.ingest.convert import ConvertOptions, bucket_groups, bucket_of, convert, stable_order
from gem_jax.data.ingest.records import RecordLayout
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, Side
from gem_jax.data.ingest.shards import ConvertedLog
from gem_jax.data.ingest.split import SplitRule
from gem_jax.data.rows import DataFormatError

USERS = [f"user {k}" for k in range(12)] + ['quo"te', "comma,user", "ünï"]
ITEMS = [f"item-{k}" for k in range(20)] + ["a|b", "x,y"]
CATEGORY = {item: f"cat{k % 4}" for k, item in enumerate(ITEMS)}
TAGS = {item: "|".join(f"t{j}" for j in range(k % 3)) for k, item in enumerate(ITEMS)}
COUNTRY = {user: ["fr", "de", "us"][k % 3] for k, user in enumerate(USERS)}

SCHEMA = EventSchema(
    user="uid", item="iid", time="ts",
    labels=(LabelRule.parse("click"), LabelRule.parse("like=rating>=4")),
    action="act", weight="w",
    features=(FeatureColumn("category", Side.ITEM), FeatureColumn("tags", Side.ITEM, multi=True), FeatureColumn("country", Side.USER)),
)


def _events(rng, n):
    users = rng.choice(USERS, n)
    items = rng.choice(ITEMS, n)
    return {
        "uid": users.tolist(),
        "iid": items.tolist(),
        "ts": rng.integers(0, 50, n).tolist(),  # many ties: order by input position
        "act": rng.choice(["view", "buy", ""], n).tolist(),
        "click": rng.integers(0, 2, n).tolist(),
        "rating": rng.integers(1, 6, n).astype(float).tolist(),
        "w": rng.uniform(0.5, 2, n).round(3).tolist(),
        "category": [CATEGORY[i] for i in items],
        "tags": [TAGS[i] for i in items],
        "country": [COUNTRY[u] for u in users],
    }


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """Two CSV files and one Parquet file (two row groups); returns (dir, events in input order)."""
    root = tmp_path_factory.mktemp("log")
    events = root / "events"
    events.mkdir()
    rng = np.random.default_rng(0)
    parts = [_events(rng, n) for n in (70, 50, 80)]
    pa_csv.write_csv(pa.table(parts[0]), events / "a.csv")
    pa_csv.write_csv(pa.table(parts[1]), events / "b.csv")
    pq.write_table(pa.table(parts[2]), events / "c.parquet", row_group_size=40)
    rows = [dict(zip(part, values)) for part in parts for values in zip(*part.values())]
    return events, rows


def _expected_flags(rows, q):
    times = np.sort([r["ts"] for r in rows])
    return times[int(np.floor(q * len(times)))]


def _decode_all(reader):
    user_ids = reader.vocab("user").ids.to_pylist()
    return {user_ids[int(rec["user"]) - 2]: rec for rec in reader}


def test_round_trip_every_event_once_in_time_order(log, tmp_path):
    events, rows = log
    result = convert([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.7"), shards=3), log=lambda _: None)
    assert result.status == "converted"
    cutoff = _expected_flags(rows, 0.7)
    assert result.manifest["split"]["cutoff"] == cutoff
    reader = ConvertedLog(tmp_path / "out")
    records = _decode_all(reader)
    assert sorted(records) == sorted({r["uid"] for r in rows})
    item_ids = reader.vocab("item").ids.to_pylist()
    actions = reader.vocab("action").ids.to_pylist()
    item_features = reader.item_features()
    category = reader.vocab("item_feature.category").ids.to_pylist()
    tags = reader.vocab("item_feature.tags").ids.to_pylist()
    country = reader.vocab("user_feature.country").ids.to_pylist()
    for user, rec in records.items():
        mine = sorted((r for r in rows if r["uid"] == user), key=lambda r: r["ts"])  # stable: input order on ties
        assert [item_ids[i - 2] for i in rec["item"]] == [r["iid"] for r in mine]
        np.testing.assert_array_equal(rec["time"], [r["ts"] for r in mine])
        assert [actions[a - 2] if a else "" for a in rec["action"]] == [r["act"] for r in mine]
        np.testing.assert_array_equal(rec["labels"], [[r["click"], r["rating"] >= 4] for r in mine])
        np.testing.assert_allclose(rec["weight"], [r["w"] for r in mine], rtol=1e-6)
        np.testing.assert_array_equal(rec["split"], [r["ts"] >= cutoff for r in mine])
        assert country[rec["user_feature/country"][0] - 2] == COUNTRY[user]
        for item in rec["item"]:
            assert category[item_features["category"][item, 0] - 2] == CATEGORY[item_ids[item - 2]]
            assert "|".join(tags[t - 2] for t in item_features["tags"][item] if t) == TAGS[item_ids[item - 2]]
    counts = result.manifest["counts"]
    assert counts["events"] == len(rows) == counts["train_events"] + counts["eval_events"]
    assert counts["eval_events"] == sum(r["ts"] >= cutoff for r in rows)
    assert result.manifest["features"][1] == {"name": "tags", "side": "item", "vocab": "vocab/item_feature.tags.csv", "vocab_size": 4, "multi": True, "max_values": 2}
    assert result.manifest["tasks"][1]["positive_rate"] == pytest.approx(np.mean([r["rating"] >= 4 for r in rows]))
    assert result.manifest["tasks"][1]["train_positive_rate"] == pytest.approx(np.mean([r["rating"] >= 4 for r in rows if r["ts"] < cutoff]))
    assert result.manifest["tasks"][1]["eval_positive_rate"] == pytest.approx(np.mean([r["rating"] >= 4 for r in rows if r["ts"] >= cutoff]))
    assert sum(result.manifest["feature_conflicts"].values()) == 0
    np.testing.assert_array_equal(np.sort(reader.lengths()), np.sort([len(rec["item"]) for rec in records.values()]))
    assert result.manifest["sequence_lengths"]["events"] == len(rows)
    # The index: per record, its events and its train events (a prefix: the rest are eval); per item, its train labels.
    in_order = list(reader)
    np.testing.assert_array_equal(reader.lengths(), [len(rec["item"]) for rec in in_order])
    np.testing.assert_array_equal(reader.train_lengths(), [int((rec["split"] == 0).sum()) for rec in in_order])
    assert all(not rec["split"][: int((rec["split"] == 0).sum())].any() for rec in in_order)
    item_events, item_positives = reader.item_train_labels()
    train_rows = [r for r in rows if r["ts"] < cutoff]
    assert item_events.sum() == len(train_rows) and item_positives.shape == (len(item_ids) + 2, 2)
    for row in range(2, len(item_ids) + 2):
        mine = [r for r in train_rows if r["iid"] == item_ids[row - 2]]
        assert item_events[row] == len(mine)
        np.testing.assert_array_equal(item_positives[row], [sum(r["click"] for r in mine), sum(r["rating"] >= 4 for r in mine)])


def test_buckets_do_not_change_the_records(log, tmp_path):
    events, _ = log
    options = dict(split=SplitRule.parse("last:2"), shards=2)
    one = convert([events], tmp_path / "one", SCHEMA, ConvertOptions(**options, buckets=1), log=lambda _: None)
    four = convert([events], tmp_path / "four", SCHEMA, ConvertOptions(**options, buckets=4), log=lambda _: None)
    assert four.manifest["counts"]["buckets"] == 4
    a, b = _decode_all(ConvertedLog(one.out)), _decode_all(ConvertedLog(four.out))
    assert a.keys() == b.keys()
    for user in a:
        for key in a[user]:
            np.testing.assert_array_equal(a[user][key], b[user][key])
        # last:2 holds out the last two events of users with more than two
        n = len(a[user]["split"])
        np.testing.assert_array_equal(a[user]["split"], [n > 2 and k >= n - 2 for k in range(n)])
    reader = ConvertedLog(four.out)
    np.testing.assert_array_equal(reader.train_lengths(), [int((rec["split"] == 0).sum()) for rec in reader])


def test_bucket_groups_fill_the_budget_in_order():
    groups = bucket_groups(np.array([3, 0, 4, 9, 2, 2, 0, 1]), 7)
    assert groups == [range(0, 3), range(3, 4), range(4, 8)]  # 7, then 9 (above the budget: alone), then 5
    assert bucket_groups(np.array([0, 0]), 1) == [range(0, 2)]
    assert bucket_groups(np.zeros(0, np.int64), 5) == []


def test_grouping_buckets_by_memory_does_not_change_the_records(log, tmp_path, monkeypatch):
    events, _ = log
    options = ConvertOptions(split=SplitRule.parse("time:0.8"), shards=2, buckets=5)
    together = convert([events], tmp_path / "together", SCHEMA, options, log=lambda _: None)
    assert together.manifest["counts"]["bucket_groups"] == 1
    monkeypatch.setattr(convert_module, "_BYTES_PER_EVENT", 1 << 40)  # room for one event at a time: a group per bucket
    lines = []
    apart = convert([events], tmp_path / "apart", SCHEMA, options, log=lines.append)
    assert apart.manifest["counts"]["bucket_groups"] == 5
    assert any("each sorted alone above the budget" in line for line in lines)
    for name in together.manifest["shards"]:
        a, b = (list(ArrayRecordReader(str(out / name)).read_all()) for out in (together.out, apart.out))
        assert a == b  # the same records, in the same order, in the same files


def test_a_log_with_more_users_than_the_index_memory_gets_more_files(log, tmp_path, monkeypatch):
    events, _ = log
    options = ConvertOptions(split=SplitRule.parse("time:0.8"))
    usual = convert([events], tmp_path / "usual", SCHEMA, options, log=lambda _: None)
    monkeypatch.setattr(shard_writer, "INDEX_BYTES_PER_RECORD", 1 << 40)  # indexes of one window's width at a time
    windowed = convert([events], tmp_path / "windowed", SCHEMA, options, log=lambda _: None)
    users = usual.manifest["counts"]["users"]
    assert len(usual.manifest["shards"]) == 15 == users  # the 15 users, one file each (fewer than 16)
    assert len(windowed.manifest["shards"]) == 15  # one window of 15 files holds 15 records
    monkeypatch.setattr(shard_writer, "WINDOW_FILES", 4)
    rolled = convert([events], tmp_path / "rolled", SCHEMA, options, log=lambda _: None)
    assert len(rolled.manifest["shards"]) == 16  # 4 windows of 4 files, 4 + 4 + 4 + 3 records
    a, b = _decode_all(ConvertedLog(usual.out)), _decode_all(ConvertedLog(rolled.out))
    assert a.keys() == b.keys()
    for user in a:
        for key in a[user]:
            np.testing.assert_array_equal(a[user][key], b[user][key])


def test_two_processes_read_disjoint_shares(log, tmp_path):
    events, rows = log
    convert([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.9"), shards=3), log=lambda _: None)
    first, second = ConvertedLog(tmp_path / "out", 0, 2), ConvertedLog(tmp_path / "out", 1, 2)
    assert [f.name for f in first.files] == ["part-00000-of-00003.array_record", "part-00002-of-00003.array_record"]
    assert [f.name for f in second.files] == ["part-00001-of-00003.array_record"]
    users = [int(r["user"]) for r in first] + [int(r["user"]) for r in second]
    assert len(users) == len(set(users)) == len({r["uid"] for r in rows})
    np.testing.assert_array_equal(second.lengths(), [len(second[i]["item"]) for i in range(len(second))])
    with pytest.raises(DataFormatError, match="3 shard file\\(s\\) for 4 processes leaves process\\(es\\) 3..3 without data"):
        ConvertedLog(tmp_path / "out", 0, 4)


def test_rerun_is_a_no_op_and_a_changed_input_is_refused(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    pa_csv.write_csv(pa.table(_events(np.random.default_rng(1), 30)), events / "a.csv")
    args = ([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.5")))
    assert convert(*args, log=lambda _: None).status == "converted"
    assert convert(*args).status == "unchanged (by size and modification time): nothing to do"
    stat = os.stat(events / "a.csv")
    os.utime(events / "a.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert convert(*args).status.startswith("unchanged (by sha256 (1 file(s) touched since, same content))")
    pa_csv.write_csv(pa.table(_events(np.random.default_rng(2), 30)), events / "a.csv")
    with pytest.raises(DataFormatError, match=r"content of 1 input file\(s\) changed \(sha256\): .*a\.csv; pass --overwrite"):
        convert(*args)
    with pytest.raises(DataFormatError, match="the settings differ \\(split\\)"):
        convert([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.6")))
    assert convert(*args, overwrite=True, log=lambda _: None).status == "converted"
    assert convert(*args).status.startswith("unchanged")
    assert not (tmp_path / "out.partial").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DataFormatError, match="mine exists and is not a converted log"):
        convert([events], tmp_path / "mine", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.5")), overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_record_reader_reads_and_keeps_records(log, tmp_path):
    """`RecordReader`: any records in any order, as `ConvertedLog` gives them; it opens only the files it reads,
    and keeps the records read last within its byte budget (the least recently used dropped first)."""
    events, _ = log
    convert([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.9"), shards=3), log=lambda _: None)
    whole = ConvertedLog(tmp_path / "out")
    raws = [whole.source[i] for i in range(len(whole))]
    budget = sum(sorted(map(len, raws))[-3:])  # room for any 3 records, not for all
    assert budget < sum(map(len, raws))
    reader = ConvertedLog(tmp_path / "out").record_reader()
    reader.cache_bytes = budget
    assert len(reader) == len(whole) and reader.opened() == ()
    first_file = np.arange(reader.first[1])
    assert reader.read(first_file[::-1]) == [raws[i] for i in first_file[::-1]]
    assert reader.opened() == (whole.files[0],)
    order = np.random.default_rng(0).permutation(len(whole))
    for _ in range(2):  # the second time partly from the kept records
        assert reader.read(order) == [raws[i] for i in order]
        assert 0 < reader._kept_bytes <= budget
    for record in (order[0], order[-1]):
        assert reader.read(np.array([record])) == [raws[record]] and list(reader._kept)[-1] == record  # the most recent
    assert reader.read(np.zeros(0, np.int64)) == []
    with pytest.raises(IndexError, match=r"record out of range \[0, \d+\)"):
        reader.read(np.array([len(whole)]))


def test_an_older_format_is_refused_and_converted_again(tmp_path):
    """A conversion of format version 1 (before the train-event index): reading it says to convert again;
    converting again with the same arguments replaces it."""
    events = tmp_path / "events"
    events.mkdir()
    pa_csv.write_csv(pa.table(_events(np.random.default_rng(1), 30)), events / "a.csv")
    args = ([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("time:0.5")))
    convert(*args, log=lambda _: None)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest | {"version": 1}))
    with pytest.raises(DataFormatError, match=r"converted by an older gem-data \(format version 1; this one reads version 2\); run gem-data convert again"):
        ConvertedLog(tmp_path / "out")
    lines = []
    assert convert(*args, log=lines.append).status == "converted"
    assert "holds a conversion of format version 1, this gem-data writes version 2" in lines[0]
    assert len(ConvertedLog(tmp_path / "out").train_lengths()) == manifest["counts"]["users"]


def test_side_tables_and_reused_vocabularies(tmp_path):
    events = tmp_path / "events.csv"
    events.write_text("u,i,t,click\nu1,i1,1,1\nu1,i2,2,0\nu2,i1,3,1\nu3,i9,4,0\n")
    (tmp_path / "items.csv").write_text("item,genres\ni1,a|b\ni2,c\ni3,a\n")
    pq.write_table(pa.table({"u": ["u1", "u2", "u4"], "age": ["20s", "30s", "40s"]}), tmp_path / "users.parquet")
    schema = EventSchema(
        user="u", item="i", time="t", labels=(LabelRule.parse("click"),),
        features=(FeatureColumn("genres", Side.ITEM, multi=True), FeatureColumn("age", Side.USER)),
        item_table=str(tmp_path / "items.csv"), item_key="item", user_table=str(tmp_path / "users.parquet"),
    )
    result = convert([events], tmp_path / "out", schema, ConvertOptions(split=SplitRule.parse("last:1")), log=lambda _: None)
    reader = ConvertedLog(tmp_path / "out")
    items = reader.vocab("item").ids.to_pylist()
    genres = reader.vocab("item_feature.genres").ids.to_pylist()
    table = reader.item_features()["genres"]
    assert {items[r - 2]: sorted(genres[g - 2] for g in table[r] if g) for r in range(2, table.shape[0])} == {"i1": ["a", "b"], "i2": ["c"], "i9": []}
    ages = reader.vocab("user_feature.age").ids.to_pylist()
    users = reader.vocab("user").ids.to_pylist()
    assert {users[int(r["user"]) - 2]: r["user_feature/age"][0] for r in reader} == {"u1": 2 + ages.index("20s"), "u2": 2 + ages.index("30s"), "u3": 0}
    assert result.manifest["feature_conflicts"] == {"items without a row in the item table": 1, "users without a row in the user table": 1}

    # Eval data through the train vocabularies: unseen ids go to OOV (row 1) and are counted.
    later = tmp_path / "later.csv"
    later.write_text("u,i,t,click\nu1,i1,9,1\nu7,i8,9,0\n")
    plain = EventSchema(user="u", item="i", time="t", labels=(LabelRule.parse("click"),))
    convert([events], tmp_path / "train", plain, ConvertOptions(split=SplitRule.parse("last:1")), log=lambda _: None)
    reused = convert([later], tmp_path / "eval", plain, ConvertOptions(split=SplitRule.parse("last:1"), vocab_from=str(tmp_path / "train")), log=lambda _: None)
    assert reused.manifest["vocabularies"]["item"]["unseen_occurrences"] == 1
    assert reused.manifest["counts"]["oov_item_events"] == 1
    assert sorted(int(r["user"]) for r in ConvertedLog(tmp_path / "eval")) == [1, 2 + ["u1", "u2", "u3"].index("u1")]
    # Users and items swapped: no item id is known there, every event's item would be OOV; refused.
    swapped = EventSchema(user="i", item="u", time="t", labels=(LabelRule.parse("click"),))
    with pytest.raises(DataFormatError, match=r"--vocab-from .*train: none of this log's 2 item occurrences \(e\.g\. 'u\d'\) is in its item vocabulary .*is --item the column"):
        convert([later], tmp_path / "swapped", swapped, ConvertOptions(split=SplitRule.parse("last:1"), vocab_from=str(tmp_path / "train")), log=lambda _: None)


def test_record_layout_round_trips():
    layout = RecordLayout(num_tasks=2, has_action=True, has_weight=False, user_features=(("country", 1), ("langs", 3)))
    users = np.zeros(1, layout.user_dtype)
    users["user"], users["user_feature/langs"] = 7, [[2, 3, 0]]
    events = np.zeros(3, layout.event_dtype)
    events["item"], events["time"], events["labels"] = [5, 6, 7], [10, 20, 30], [[1, 0], [0, 1], [1, 1]]
    (raw,) = layout.records(users, events, np.array([0, 3]))
    record = layout.decode(raw)
    assert int(record["user"]) == 7 and record["user_feature/langs"].tolist() == [2, 3, 0]
    assert record["item"].tolist() == [5, 6, 7] and record["labels"].dtype == np.float32 and record["labels"].shape == (3, 2)
    assert RecordLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


@pytest.mark.parametrize(
    "major_range, minor_range",
    [((0, 50), (0, 30)), ((0, 5000), (1_600_000_000, 1_700_000_000)), ((-3, 4), (0, 9)), ((0, 1 << 40), (0, 1 << 40)), ((7, 8), (5, 6))],
)
def test_stable_order_is_lexsort(major_range, minor_range):
    # many ties, a negative major and spans too wide for one key fall back or repair ties in input order
    rng = np.random.default_rng(sum(major_range) % 1000)
    for n in (0, 1, 17, 20_000):
        major, minor = rng.integers(*major_range, n), rng.integers(*minor_range, n)
        np.testing.assert_array_equal(stable_order(major.astype(np.int32) if major_range[1] < 1 << 31 else major, minor), np.lexsort((minor, major)))


def test_bucket_of_is_a_function_of_the_id():
    ids = pa.array([f"user-{k}" for k in range(4000)])
    buckets = bucket_of(ids, 8)
    np.testing.assert_array_equal(bucket_of(ids.slice(1000, 10), 8), buckets[1000:1010])
    np.testing.assert_array_equal(bucket_of(pa.array(["user-7", "user-7"]), 8), [buckets[7]] * 2)
    assert np.bincount(buckets, minlength=8).min() > 400  # about 500 each


def test_read_all_is_every_record_in_index_order(log, tmp_path):
    """`ConvertedLog.read_all` of each process's share: the records `reader[i]` returns, as columns; a record
    whose size does not match its header is refused."""
    events, _ = log
    convert([events], tmp_path / "out", SCHEMA, ConvertOptions(split=SplitRule.parse("last:1"), shards=3), log=lambda _: None)
    for index in range(2):
        reader = ConvertedLog(tmp_path / "out", index, 2)
        users, columns, starts = reader.read_all(block=4)  # several blocks
        assert len(users) == len(reader) and starts[-1] == columns.shape[0] == reader.lengths().sum()
        for i, record in enumerate(reader):
            for name in reader.layout.user_dtype.names:
                np.testing.assert_array_equal(users[name][i], record[name])
            for name in reader.layout.event_dtype.names:
                np.testing.assert_array_equal(columns[name][starts[i] : starts[i + 1]], record[name])
    layout = reader.layout
    raw = reader.source[0]
    with pytest.raises(ValueError, match="record 1 holds .* bytes, its header says"):
        layout.decode_many([raw, raw[:-1]])
    with pytest.raises(ValueError, match="record 0 holds 3 bytes, fewer than its"):
        layout.decode_many([raw[:3]])


DUPLICATE_SCHEMA = EventSchema(
    user="u", item="i", time="t", labels=(LabelRule.parse("click"), LabelRule.parse("like=r>=4")), action="a", weight="w",
    features=(FeatureColumn("tags", Side.ITEM, multi=True), FeatureColumn("country", Side.USER)),
)
DUPLICATE_HEADER = "u,i,t,click,r,a,w,tags,country\n"


def _convert_cli(inputs, out, capsys) -> tuple[dict, list[str]]:
    """`gem-data convert` of `inputs` under `DUPLICATE_SCHEMA`: (the manifest, the summary lines that name duplicates)."""
    from gem_jax import data_cli

    data_cli.main([
        "convert", *map(str, inputs), "--out", str(out), "--user", "u", "--item", "i", "--time", "t", "--label", "click",
        "--label", "like=r>=4", "--action", "a", "--weight", "w", "--item-feature", "tags:multi", "--user-feature", "country",
        "--split", "last:1", "--quiet",
    ])
    lines = [line for line in capsys.readouterr().out.splitlines() if "duplicate event" in line]
    return json.loads((out / "manifest.json").read_text()), lines


def test_exact_duplicate_events_are_counted_kept_and_named(tmp_path, capsys):
    """Rows equal to an earlier row in every column read, as parsed, are counted and kept, and the first is named by
    file and line; a row that differs in its time, or only in the value a rule label reads, is none."""
    path = tmp_path / "a.csv"
    path.write_text(
        DUPLICATE_HEADER
        + "u1,x,5,1,4,view,1.5,p|q,fr\n"  # line 2
        + "u2,y,5,0,2,,1,,de\n"  # line 3
        + "u1,x,6,1,4,view,1.5,p|q,fr\n"  # line 4: line 2 at another time
        + "u1,x,5,1,5,view,1.5,p|q,fr\n"  # line 5: line 2 but r 5 (the same like label)
        + "u1,x,5,1,4,view,1.5,p|q,fr\n"  # line 6: a copy of line 2
        + "u2,y,5,0,2.0,,1.0,,de\n"  # line 7: a copy of line 3 once parsed
    )
    manifest, lines = _convert_cli([path], tmp_path / "out", capsys)
    assert manifest["counts"]["duplicate_events"] == 2 and manifest["counts"]["events"] == 6
    assert manifest["first_duplicate_event"] == {"file": str(path), "location": "line 6", "copy_of": "line 2"}
    assert lines == [f"  2 duplicate event(s), kept: rows equal in every column read to an earlier row (first: {path}, line 6, a copy of line 2)"]
    reader = ConvertedLog(tmp_path / "out")
    users = reader.vocab("user").ids.to_pylist()
    assert {users[int(r["user"]) - 2]: r["time"].tolist() for r in reader} == {"u1": [5, 5, 5, 6], "u2": [5, 5]}  # every row kept

    # A copy in a later file, a Parquet one: named by row group and row, and the file it repeats.
    first = tmp_path / "b.csv"
    first.write_text(DUPLICATE_HEADER + "u1,x,5,1,4,view,1.5,p|q,fr\nu2,y,5,0,2,,1,,de\n")
    rows = {"u": ["u3", "u4", "u1"], "i": ["x", "y", "x"], "t": [1, 2, 5], "click": [1, 0, 1], "r": [4.0, 2.0, 4.0], "a": ["view", None, "view"],
            "w": [1.0, 1.0, 1.5], "tags": ["p", "", "p|q"], "country": ["fr", "de", "fr"]}
    pq.write_table(pa.table(rows), tmp_path / "c.parquet", row_group_size=2)
    manifest, lines = _convert_cli([first, tmp_path / "c.parquet"], tmp_path / "two", capsys)
    assert manifest["counts"]["duplicate_events"] == 1
    assert manifest["first_duplicate_event"] == {"file": str(tmp_path / "c.parquet"), "location": "row group 1, row 0", "copy_of": f"{first}, line 2"}
    assert lines == [f"  1 duplicate event(s), kept: rows equal in every column read to an earlier row (first: {tmp_path / 'c.parquet'}, row group 1, row 0, a copy of {first}, line 2)"]


def test_a_log_without_duplicates_counts_none_and_says_nothing(tmp_path, capsys):
    path = tmp_path / "a.csv"
    path.write_text(DUPLICATE_HEADER + "u1,x,5,1,4,view,1.5,p|q,fr\nu1,x,5,1,4,view,1.5,q|p,fr\nu1,x,5,1,4,,1.5,p|q,fr\nu2,x,5,1,4,view,1.5,p|q,fr\n")
    manifest, lines = _convert_cli([path], tmp_path / "out", capsys)
    assert manifest["counts"]["duplicate_events"] == 0 and manifest["first_duplicate_event"] is None and lines == []


def test_a_manifest_without_the_duplicate_count_still_reads(tmp_path, capsys):
    """A conversion written before duplicate events were counted: read, inspected and left alone by a re-run,
    which says nothing of duplicates (not counted, rather than none)."""
    from gem_jax.data.ingest.inspect import format_report, inspect_converted
    from gem_jax.data.ingest.manifest import DUPLICATES_NOT_COUNTED

    path = tmp_path / "a.csv"
    path.write_text(DUPLICATE_HEADER + "u1,x,5,1,4,view,1.5,p|q,fr\nu1,x,5,1,4,view,1.5,p|q,fr\nu2,y,6,0,2,,1,,de\n")
    manifest, lines = _convert_cli([path], tmp_path / "out", capsys)
    assert manifest["counts"]["duplicate_events"] == 1 and len(lines) == 1
    del manifest["counts"]["duplicate_events"], manifest["first_duplicate_event"]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert len(ConvertedLog(tmp_path / "out")) == 2
    report = format_report(inspect_converted(tmp_path / "out")).splitlines()
    assert "events 3, users 2, items 2, time 5 .. 6" in report and DUPLICATES_NOT_COUNTED in report
    again, lines = _convert_cli([path], tmp_path / "out", capsys)
    assert again == manifest and lines == []


def _brute_force_duplicates(table: pa.Table) -> set[tuple[int, int]]:
    first, pairs = {}, set()
    columns = [name for name in table.column_names if name != "source"]
    for row, values in enumerate(zip(*(table[name].to_pylist() for name in columns))):
        key = tuple(tuple(v) if isinstance(v, list) else v for v in values)
        if key in first:
            pairs.add((row, first[key]))
        first.setdefault(key, row)
    return pairs


@pytest.mark.parametrize("seed", range(4))
def test_duplicate_rows_are_the_rows_equal_to_an_earlier_one(seed):
    """`duplicate_rows` against a dictionary of whole rows: few values per column, so many ties and copies;
    null and empty values, lists in another order, -0.0 and 0.0."""
    rng = np.random.default_rng(seed)
    n = 3000
    tags = [["a"], ["a", "b"], ["b", "a"], [], ["a b"], ["a", "b", "c"]]
    table = pa.table({
        "user": pa.array(rng.choice(["u1", "u2", "u3"], n)),
        "item": pa.array(rng.choice(["x", "y"], n)),
        "time": pa.array(rng.integers(0, 4, n)),
        "action": pa.array([None if k == 2 else ["view", "buy"][k] for k in rng.integers(0, 3, n)], pa.string()),
        "label/click": pa.array(rng.integers(0, 2, n).astype(np.uint8)),
        "weight": pa.array(rng.choice([0.0, -0.0, 1.5], n).astype(np.float32)),
        "feature/tags": pa.array([tags[k] for k in rng.integers(0, len(tags), n)], pa.list_(pa.string())),
        "value/r": pa.array(rng.choice([4.0, 4.5], n)),
        "source": pa.array(np.arange(n, dtype=np.int64)),
    })
    users = pc.dictionary_encode(table["user"]).combine_chunks().indices.to_numpy()
    times = table["time"].to_numpy()
    copies, originals = convert_module.duplicate_rows(table, users, times, stable_order(users, times))
    expected = _brute_force_duplicates(table)  # -0.0 == 0.0 in Python as in numpy
    assert set(zip(copies.tolist(), originals.tolist())) == expected and copies.size == len(expected) > 0
    # One row; two rows of one user and time that differ only in the column compared last: none.
    assert convert_module.duplicate_rows(table.slice(0, 1), users[:1], times[:1], np.zeros(1, np.int64))[0].size == 0
    pair = pa.table({"user": ["u", "u"], "item": ["x", "x"], "time": [1, 1], "value/r": [4.0, 4.5], "source": [0, 1]})
    assert convert_module.duplicate_rows(pair, np.zeros(2, np.int32), np.ones(2, np.int64), np.arange(2))[0].size == 0
