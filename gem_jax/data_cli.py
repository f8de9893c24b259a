"""Command-line entry point: `gem-data` (also `python -m gem_jax.data_cli`).

    gem-data inspect events/ --user user_id --item item_id --time ts
    gem-data convert events/ --out data/mylog --user user_id --item item_id --time ts \\
        --label click --label purchase --item-feature category --user-feature country --split time:0.9
    gem-data inspect data/mylog --batch-size 1024 --gpus 8
    gem-data plant --out data/planted --preset long-range     # a log whose optimum is known
    gem-data oracle data/planted --split time:0.9             # its oracle and baseline on a split

Exit status: 0 done (or nothing to do); 2 refused (a malformed row, a missing or
mistyped column, files that disagree, an output holding another conversion).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import sys
import tempfile
from pathlib import Path

from gem_jax.checks import output_directory_problem, positive_int


def _schema_flags(parser: argparse.ArgumentParser, required: bool) -> None:
    group = parser.add_argument_group("columns (the event schema)")
    group.add_argument("--user", required=required, help="user id column")
    group.add_argument("--item", required=required, help="item id column")
    group.add_argument("--time", required=required, help="timestamp column: integers, ISO 8601 dates/times, or Parquet timestamps")
    group.add_argument("--action", help="event-type column (categorical), optional")
    group.add_argument("--label", action="append", default=[], metavar="RULE", help="a task: a 0/1 column (click) or name=rule (like=rating>=4); names are letters, digits and _; repeatable")
    group.add_argument("--weight", help="per-event weight column (finite, >= 0), optional")
    group.add_argument("--item-feature", action="append", default=[], metavar="COLUMN[:multi]", help="categorical item feature; :multi splits values at --multi-separator; repeatable")
    group.add_argument("--user-feature", action="append", default=[], metavar="COLUMN[:multi]", help="categorical user feature; repeatable")
    group.add_argument("--item-table", help="file/dir/glob of an item table holding the item features (joined by id)")
    group.add_argument("--item-key", help="the item table's id column (default: --item)")
    group.add_argument("--user-table", help="file/dir/glob of a user table holding the user features")
    group.add_argument("--user-key", help="the user table's id column (default: --user)")
    group.add_argument("--delimiter", default=",", help="CSV field delimiter (default ','; .tsv files default to a tab); '\\t' for a tab")
    group.add_argument("--multi-separator", default="|", help="separator of multi-valued features (default '|')")
    group.add_argument("--on-bad-row", choices=["error", "skip"], default="error", help="error (default): stop at the first malformed row; skip: drop and count them")


def _memory_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`--memory-mb` (`convert.memory_plan`), its help saying `what` the budget sets."""
    parser.add_argument("--memory-mb", type=int, default=2048, help=f"memory budget in MiB: {what} (default 2048)")


def _schema(args):
    from gem_jax.data.ingest.schema import EventSchema, FeatureColumn, LabelRule, Side

    features = tuple(FeatureColumn.parse(text, Side.ITEM) for text in args.item_feature)
    features += tuple(FeatureColumn.parse(text, Side.USER) for text in args.user_feature)
    return EventSchema(
        user=args.user, item=args.item, time=args.time,
        labels=tuple(LabelRule.parse(text) for text in args.label),
        action=args.action, weight=args.weight, features=features,
        item_table=args.item_table, user_table=args.user_table, item_key=args.item_key, user_key=args.user_key,
        delimiter="\t" if args.delimiter in ("\\t", "tab") else args.delimiter,
        multi_separator=args.multi_separator,
    )


def _on_bad_row(args):
    from gem_jax.data.rows import OnBadRow

    return OnBadRow.SKIP if args.on_bad_row == "skip" else OnBadRow.RAISE


@contextlib.contextmanager
def _termination_exits():
    """While the body runs, SIGTERM and SIGHUP raise SystemExit(128 + the signal's number), so the body's `with`
    blocks clean up as they do on Ctrl-C, and the exit status is the one the signal would give."""

    def exit_on(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _inspect(args) -> None:
    from gem_jax.data.bbs import check_shard_split
    from gem_jax.data.ingest import inspect
    from gem_jax.data.ingest.manifest import MANIFEST
    from gem_jax.data.ingest.readers import expand_inputs

    converted = len(args.inputs) == 1 and (Path(args.inputs[0]) / MANIFEST).is_file()
    layout_where = f"--batch-size {args.batch_size} on --gpus {args.gpus}"
    if args.batch_size is not None:  # before a pass over the log
        check_shard_split(args.batch_size, args.gpus, layout_where)
    if converted:
        report = inspect.inspect_converted(args.inputs[0])
    else:
        if not (args.user and args.item and args.time):
            expand_inputs(args.inputs)  # a path that does not exist (or holds no event files) is said first
            raise ValueError("raw inputs need --user, --item and --time (or pass one converted directory)")
        with _termination_exits():  # the bucket files' temporary folder is removed on SIGTERM and SIGHUP too
            report = inspect.inspect_raw(args.inputs, _schema(args), _on_bad_row(args), args.memory_mb)
    if args.batch_size is not None:
        inspect.add_layout(report, args.batch_size, args.gpus, args.max_seq_len, where=layout_where)
    print(inspect.format_report(report))
    figure = args.figure or (Path(args.inputs[0]) / "length_histogram.png" if converted else None)
    if figure is not None:
        if inspect.save_figure(report, figure):
            print(f"figure: {figure}")
        else:
            print("figure: not drawn (matplotlib is not installed)")


def _convert(args) -> None:
    from gem_jax.data.ingest.convert import ConvertOptions, convert
    from gem_jax.data.ingest.manifest import describe_duplicates
    from gem_jax.data.ingest.split import SplitRule

    options = ConvertOptions(
        split=SplitRule.parse(args.split), min_count=args.min_count, max_vocab=args.max_vocab, shards=args.shards,
        memory_mb=args.memory_mb, on_bad_row=_on_bad_row(args), vocab_from=args.vocab_from,
    )
    result = convert(args.inputs, args.out, _schema(args), options, overwrite=args.overwrite, log=(lambda line: None) if args.quiet else print)
    manifest, counts = result.manifest, result.manifest["counts"]
    print(f"{result.out}: {result.status}")
    print(
        f"events {counts['events']} (train {counts['train_events']}, eval {counts['eval_events']}), users {counts['users']}, items {counts['items']}, "
        f"{len(manifest['shards'])} shard(s), split {manifest['split']['description']}"
        + (f" (cutoff {manifest['split']['cutoff']})" if manifest["split"]["cutoff"] is not None else "")
    )
    for name, vocab in manifest["vocabularies"].items():
        if "unseen_occurrences" in vocab:  # reused (--vocab-from): its counts are the other log's
            print(f"  vocab {name}: {vocab['rows']} rows, reused; {vocab['unseen_occurrences']} occurrences in this log are not in it and go to OOV")
        else:
            print(f"  vocab {name}: {vocab['rows']} rows ({vocab['ids']} ids, {vocab['dropped_ids']} dropped, {vocab['oov_count']} occurrences to OOV)")
    for entry in manifest["skipped_rows"]:
        print(f"  skipped {entry['count']} row(s) of {entry['file']}: {entry['kind']} (first: {entry['first']})")
    if counts.get("duplicate_events"):  # not counted in a conversion by an earlier gem-data
        print(f"  {counts['duplicate_events']} duplicate event(s), kept: {describe_duplicates(manifest['first_duplicate_event'])}")
    for what, count in manifest["feature_conflicts"].items():
        if count:
            print(f"  {what}: {count}")


def _plant(args) -> None:
    import dataclasses
    import json
    import time

    from gem_jax.data.ingest.readers import Format
    from gem_jax.data.ingest.split import SplitRule
    from gem_jax.data.planted import PRESETS, convert_command, generate, read_truth, small, write_planted
    from gem_jax.train.oracle import oracle_report

    rule = SplitRule.parse(args.split)
    config = small(PRESETS[args.preset]) if args.small else PRESETS[args.preset]
    if args.max_length is not None and args.max_length < config.min_length:
        raise ValueError(f"--max-length {args.max_length}: the {args.preset} preset's histories start at {config.min_length} events; give --max-length >= {config.min_length}")
    config = dataclasses.replace(config, seed=args.seed, max_length=config.max_length if args.max_length is None else args.max_length)
    started = time.perf_counter()
    log = generate(config)
    generated = time.perf_counter()
    files = write_planted(log, args.out, Format(args.format), overwrite=args.overwrite)
    print(
        f"{files.directory}: {log.num_events} events, {config.num_users} users, {config.num_items} items "
        f"(generated in {generated - started:.1f} s, written in {time.perf_counter() - generated:.1f} s), positive rate {log.click.mean():.4f}"
    )
    report = oracle_report(read_truth(files.truth), rule)
    (files.directory / "oracle.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(report.summary())
    print(f"convert with:\n  {convert_command(files, f'{files.directory}-converted', args.split)}")


def _oracle(args) -> None:
    from gem_jax.data.ingest.manifest import MANIFEST
    from gem_jax.data.ingest.split import SplitRule
    from gem_jax.data.planted import TRUTH, read_truth
    from gem_jax.train.oracle import oracle_report

    directory = Path(args.directory)
    if not (directory / TRUTH).is_file():
        if not directory.exists():
            what = "no such directory"
        elif not directory.is_dir():
            what = "not a directory"
        elif (directory / MANIFEST).is_file():
            what = f"a converted directory, which holds no {TRUTH} (pass the planted log it was converted from)"
        else:
            what = f"holds no {TRUTH}"
        raise ValueError(f"{directory}: {what}; the directory must be a planted log written by gem-data plant (holding {TRUTH})")
    rule = SplitRule.parse(args.split)
    print(oracle_report(read_truth(directory / TRUTH), rule).summary())


def main(argv: list[str] | None = None) -> None:
    """`gem-data {inspect,convert,plant,oracle} ...`; see `gem-data COMMAND --help`."""
    from gem_jax.data.planted.config import PRESETS

    parser = argparse.ArgumentParser(prog="gem-data", description="Inspect and convert your own event log (CSV/TSV/Parquet) for gem-train; plant a log whose optimum is known.")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect_parser = commands.add_parser("inspect", help="counts, label rates, sequence lengths, padding and GPU balance of a raw log or a converted directory")
    inspect_parser.add_argument("inputs", nargs="+", help="event files, directories or globs; or one converted directory")
    _schema_flags(inspect_parser, required=False)
    inspect_parser.add_argument("--batch-size", type=positive_int, help="global batch size (>= 1) for the padding and balance estimate; a multiple of --gpus, with an even share per GPU when --gpus > 1")
    inspect_parser.add_argument("--gpus", type=positive_int, default=1, help="data-parallel GPUs (>= 1, default 1)")
    inspect_parser.add_argument("--max-seq-len", type=positive_int, help="longest history kept (>= 1; default: the longest sequence)")
    inspect_parser.add_argument("--figure", help="save the length histogram here (default for a converted directory: DIR/length_histogram.png)")
    _memory_flag(inspect_parser, "sets the bucket count and the groups of buckets compared for duplicate events, as gem-data convert's (a raw log)")

    convert_parser = commands.add_parser("convert", help="vocabularies, split and per-user sequences in sharded ArrayRecord files")
    convert_parser.add_argument("inputs", nargs="+", help="event files, directories or globs")
    convert_parser.add_argument("--out", required=True, help="output directory")
    _schema_flags(convert_parser, required=True)
    convert_parser.add_argument("--split", default="time:0.9", help="time:Q (quantile), time:DATE, time:T or last:N (default time:0.9)")
    convert_parser.add_argument("--min-count", type=int, default=1, help="user/item ids seen fewer times go to the OOV row (default 1)")
    convert_parser.add_argument("--max-vocab", type=int, help="keep at most this many user ids and item ids each (the most frequent)")
    convert_parser.add_argument("--shards", type=int, help="shard files (default: 16, fewer with fewer users, more when their indexes would not fit --memory-mb); a multiple of the reading processes")
    _memory_flag(convert_parser, "sets the bucket count, the sorting groups and the shard files open at once")
    convert_parser.add_argument("--vocab-from", help="reuse the vocabularies of this converted directory (unseen ids -> OOV, counted)")
    convert_parser.add_argument("--overwrite", action="store_true", help="convert again when OUT holds a conversion of other inputs or settings")
    convert_parser.add_argument("--quiet", action="store_true", help="no progress lines")

    plant_parser = commands.add_parser("plant", help="write a synthetic event log with planted click signals and a known optimum (gem_jax.data.planted)")
    plant_parser.add_argument("--out", required=True, help="output directory (events, items, truth.parquet, planted.json, oracle.json)")
    plant_parser.add_argument("--preset", choices=list(PRESETS), default="long-range", help="long-range (default): recent, mid-range and long-range signals; short-range: no long-range signal")
    plant_parser.add_argument("--small", action="store_true", help="1/10 of the users, items and categories (about 180k events instead of 1.9M)")
    plant_parser.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    plant_parser.add_argument("--max-length", type=int, help="longest history (default 1024; e.g. 4096 for a longer tail)")
    plant_parser.add_argument("--format", choices=["parquet", "csv"], default="parquet", help="file format of the events and items (default parquet)")
    plant_parser.add_argument("--split", default="time:0.9", help="the split the oracle is reported on, as gem-data convert --split (default time:0.9)")
    plant_parser.add_argument("--overwrite", action="store_true", help="replace a planted log already in OUT")

    oracle_parser = commands.add_parser("oracle", help="a planted log's oracle, item-mean baseline and history ablations (AUC, NE) on a split")
    oracle_parser.add_argument("directory", help="a directory written by gem-data plant")
    oracle_parser.add_argument("--split", default="time:0.9", help="as gem-data convert --split (default time:0.9)")

    args = parser.parse_args(argv)
    if args.command in ("convert", "plant") and (problem := output_directory_problem(args.out, "--out")):
        parser.error(problem)
    run = {"inspect": _inspect, "convert": _convert, "plant": _plant, "oracle": _oracle}[args.command]
    try:
        run(args)
    except ValueError as error:  # BadRowError, DataFormatError, SchemaError, option values out of range
        print(f"gem-data {args.command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as error:
        full = error.errno == errno.ENOSPC or "No space left on device" in str(error)  # pyarrow's writers say it in text
        if not full or args.command == "oracle":  # oracle writes nothing
            raise
        folder = f"the temporary folder {tempfile.gettempdir()} (TMPDIR)" if args.command == "inspect" else f"--out {args.out}"
        print(f"gem-data {args.command}: error: no space left on the device of {folder}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
