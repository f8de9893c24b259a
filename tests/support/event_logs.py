"""A small event log of one's own for tests of `Source.EVENTS`: string ids, two CSV files and a Parquet file,
two tasks, an action, a weight, a single- and a multi-valued item feature and a user feature."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from gem_jax.data.ingest.convert import ConvertOptions, ConvertResult, convert
from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, Side
from gem_jax.data.ingest.split import SplitRule

USERS = [f"user {k}" for k in range(10)] + ['quo"te', "comma,user", "ünï"]
EARLY, LATE = "early bird", "night owl"  # one event at time 0; three events at times 97 to 99
ITEMS = [f"item-{k}" for k in range(16)] + ["a|b", "x,y"]
CATEGORY = {item: f"cat{k % 4}" for k, item in enumerate(ITEMS)}
TAGS = {item: "|".join(f"t{j}" for j in range(k % 3)) for k, item in enumerate(ITEMS)}  # 0 to 2 tags
COUNTRY = {user: ["fr", "de", "us"][k % 3] for k, user in enumerate(USERS + [EARLY, LATE])}
EVAL_FROM = 50  # train events have times in [0, 50), eval events in [50, 100)

SCHEMA = EventSchema(
    user="uid", item="iid", time="ts",
    labels=(LabelRule.parse("click"), LabelRule.parse("like=rating>=4")),
    action="act", weight="w",
    features=(FeatureColumn("category", Side.ITEM), FeatureColumn("tags", Side.ITEM, multi=True), FeatureColumn("country", Side.USER)),
)


def write_event_log(directory: Path, *, num_train: int, num_eval: int, seed: int = 0) -> list[dict]:
    """Writes `a.csv`, `b.csv` and `c.parquet` (two row groups) to `directory`, in random row order; returns
    the rows in input order (the files' order). `num_train` events have times below `EVAL_FROM` (many ties),
    `num_eval` at or above it; user `EARLY` has one event at time 0, user `LATE` three, the log's last (times 97 to 99)."""
    rng = np.random.default_rng(seed)
    times = np.concatenate([[0], rng.integers(1, EVAL_FROM, num_train - 1), rng.integers(EVAL_FROM, 100, num_eval)])
    users = rng.choice(USERS, times.size).astype(object)
    users[0], users[-3:], times[-3:] = EARLY, LATE, [97, 98, 99]
    items = rng.choice(ITEMS, times.size)
    rows = [
        {
            "uid": str(user), "iid": str(item), "ts": int(ts),
            "act": str(rng.choice(["view", "buy", ""])),
            "click": int(rng.integers(0, 2)), "rating": float(rng.integers(1, 6)),
            "w": round(float(rng.uniform(0.5, 2.0)), 3),
            "category": CATEGORY[item], "tags": TAGS[item], "country": COUNTRY[str(user)],
        }
        for user, item, ts in zip(users, items, times)
    ]
    rows = [rows[k] for k in rng.permutation(len(rows))]
    directory.mkdir(parents=True, exist_ok=True)
    cuts = [0, len(rows) * 2 // 5, len(rows) * 3 // 5, len(rows)]
    parts = [pa.Table.from_pylist(rows[a:b]) for a, b in zip(cuts, cuts[1:])]
    pa_csv.write_csv(parts[0], directory / "a.csv")
    pa_csv.write_csv(parts[1], directory / "b.csv")
    pq.write_table(parts[2], directory / "c.parquet", row_group_size=max(1, parts[2].num_rows // 2))
    return rows


def convert_event_log(events: Path, out: Path, split: str = f"time:{EVAL_FROM}", shards: int = 3, schema: EventSchema = SCHEMA) -> ConvertResult:
    """`gem-data convert` of `write_event_log`'s files under `schema`, quietly."""
    return convert([events], out, schema, ConvertOptions(split=SplitRule.parse(split), shards=shards), log=lambda _: None)
