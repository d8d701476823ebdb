"""`kvlab store`: list, read, write, remove, verify and clear entries of a KV store given by its URL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvlab.cli.base import EXIT_OK, EXIT_RUNTIME_ERROR, Command, add_json_flag, add_subcommand, print_json
from kvlab.errors import ConfigError
from kvlab.store import KVStore, StoredValueError, StoreUnavailableError, check_key, create_store

URL_HELP = ("store URL: memory://, file:///absolute/dir, redis://[:PASSWORD@]host:port/db[?timeout=SECONDS], "
            "rediss://...?ssl_ca_certs=PEM or redis+unix:///path/to/redis.sock (percent-encode @ : / # in "
            "passwords, or set KVLAB_REDIS_PASSWORD so the password stays out of `ps`)")


class StoreCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        verbs = parser.add_subparsers(dest="store_verb", required=True, metavar="VERB")
        ls = add_subcommand(verbs, "ls", "list keys with their sizes and the total")
        ls.add_argument("url", help=URL_HELP)
        ls.add_argument("--prefix", default="", help="only keys that start with this")
        add_json_flag(ls)
        put = add_subcommand(verbs, "put", "store the bytes of a file under a key")
        put.add_argument("url", help=URL_HELP)
        put.add_argument("key", help="store key (A-Z a-z 0-9 _ - ., up to 200 characters)")
        put.add_argument("file", help="file to read, or - for stdin")
        get = add_subcommand(verbs, "get", "write the bytes under a key to stdout or a file")
        get.add_argument("url", help=URL_HELP)
        get.add_argument("key", help="store key")
        get.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
        rm = add_subcommand(verbs, "rm", "remove keys (absent keys are not an error)")
        rm.add_argument("url", help=URL_HELP)
        rm.add_argument("keys", nargs="+", metavar="KEY", help="store keys")
        stats = add_subcommand(verbs, "stats", "number of keys and total bytes")
        stats.add_argument("url", help=URL_HELP)
        add_json_flag(stats)
        verify = add_subcommand(
            verbs, "verify", "open and decode every value (tags too, with KVLAB_STORE_SECRET); exit 1 if any fails"
        )
        verify.add_argument("url", help=URL_HELP)
        verify.add_argument("--prefix", default="", help="only keys that start with this")
        verify.add_argument("--delete", action="store_true", help="remove each value that fails, right after its check")
        verify.add_argument("--max-value-bytes", type=int, default=None, metavar="N",
                            help="values larger than this fail unread (default: the most two frames within the "
                                 "1 GiB decode limit can take, about 2.3 GB)")
        add_json_flag(verify)
        clear = add_subcommand(verbs, "clear", "remove every key (or every key under --prefix)")
        clear.add_argument("url", help=URL_HELP)
        clear.add_argument("--prefix", default="", help="only keys that start with this")
        clear.add_argument("--yes", action="store_true", help="do not ask for confirmation (needed without a terminal)")

    def run(self, args: argparse.Namespace) -> int:
        actions = {"ls": _ls, "put": _put, "get": _get, "rm": _rm, "stats": _stats, "verify": _verify, "clear": _clear}
        # Only `put` may create a store: reading a mistyped path must not leave an empty one behind.
        store = create_store(args.url, create=args.store_verb == "put")
        try:
            return actions[args.store_verb](store, args)
        except (StoreUnavailableError, StoredValueError) as error:
            print(f"kvlab store: error: {error}", file=sys.stderr)
            return EXIT_RUNTIME_ERROR
        finally:
            store.close()


def _sizes(store: KVStore, prefix: str) -> list[dict[str, Any]]:
    """Each key's size; a key that holds no value (a Redis hash, ...) gets `bytes` None and a `problem`."""
    rows: list[dict[str, Any]] = []
    for key in store.keys(prefix):
        try:
            size = store.nbytes(key)
        except StoredValueError as error:
            rows.append({"key": key, "bytes": None, "problem": str(error)})
            continue
        # A key removed by another client between listing and sizing is no longer in the store.
        if size is not None:
            rows.append({"key": key, "bytes": size})
    return rows


def _ls(store: KVStore, args: argparse.Namespace) -> int:
    rows = _sizes(store, args.prefix)
    total = sum(row["bytes"] or 0 for row in rows)
    if args.json:
        print_json({"url": store.url, "prefix": args.prefix, "keys": rows, "num_keys": len(rows), "total_bytes": total})
        return EXIT_OK
    for row in rows:
        if row["bytes"] is None:
            print(f"{'?':>12}  {row['key']}  ({row['problem']})")
        else:
            print(f"{row['bytes']:>12}  {row['key']}")
    print(f"{len(rows)} keys, {total} bytes")
    return EXIT_OK


def _put(store: KVStore, args: argparse.Namespace) -> int:
    check_key(args.key)
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(args.file).read_bytes()
        except OSError as error:
            raise ConfigError(f"cannot read {args.file}: {error.strerror or error}") from None
    store.put(args.key, data)
    print(f"stored {len(data)} bytes under {args.key}")
    return EXIT_OK


def _get(store: KVStore, args: argparse.Namespace) -> int:
    data = store.get(args.key)
    if data is None:
        print(f"kvlab store: error: no value under key {args.key!r} in {store.url}; "
              "`kvlab store ls URL` lists the keys", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    if args.output is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return EXIT_OK
    try:
        args.output.write_bytes(data)
    except OSError as error:
        raise ConfigError(f"cannot write {args.output}: {error.strerror or error}") from None
    return EXIT_OK


def _rm(store: KVStore, args: argparse.Namespace) -> int:
    # Check every key before removing any, so a typo in one key does not leave the removal half done.
    for key in args.keys:
        check_key(key)
    num_removed = 0
    for key in args.keys:
        num_removed += store.contains(key)
        store.delete(key)
    print(f"removed {num_removed} of {len(args.keys)} keys")
    return EXIT_OK


def _stats(store: KVStore, args: argparse.Namespace) -> int:
    rows = _sizes(store, "")
    stats = {"url": store.url, "num_keys": len(rows), "total_bytes": sum(row["bytes"] or 0 for row in rows)}
    if args.json:
        print_json(stats)
        return EXIT_OK
    print(f"{store.url}: {stats['num_keys']} keys, {stats['total_bytes']} bytes")
    return EXIT_OK


def _verify(store: KVStore, args: argparse.Namespace) -> int:
    from kvlab.store import ChunkSealer
    from kvlab.store.verify import MAX_VALUE_BYTES, verify_store

    if args.max_value_bytes is not None and args.max_value_bytes < 0:
        raise ConfigError(f"--max-value-bytes must be at least 0, got {args.max_value_bytes}")
    keys = store.keys(args.prefix)
    bound = MAX_VALUE_BYTES if args.max_value_bytes is None else args.max_value_bytes
    with tqdm(total=len(keys), desc="verify", unit="value", disable=args.json or not sys.stderr.isatty()) as bar:
        checks = list(verify_store(store, ChunkSealer.from_environment(), args.prefix, lambda _: bar.update(),
                                   delete=args.delete, max_bytes=bound))
    failed = [check for check in checks if not check.ok]
    if args.json:
        print_json({
            "url": store.url,
            "num_values": len(checks),
            "num_failed": len(failed),
            "deleted": args.delete,
            "failed": [{"key": c.key, "bytes": c.nbytes, "problem": c.problem} for c in failed],
        })
    else:
        for check in failed:
            print(f"FAILED  {check.key}  ({check.nbytes} bytes): {check.problem}")
        removed = f"; removed the {len(failed)} that failed" if args.delete and failed else ""
        print(f"{len(checks)} values checked, {len(failed)} failed{removed}")
    return EXIT_RUNTIME_ERROR if failed and not args.delete else EXIT_OK


def _clear(store: KVStore, args: argparse.Namespace) -> int:
    keys = store.keys(args.prefix)
    what = f"{len(keys)} keys" + (f" under {args.prefix!r}" if args.prefix else "")
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"clearing {what} of {store.url} needs --yes when not run from a terminal")
        answer = input(f"remove {what} from {store.url}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_OK
    for key in keys:
        store.delete(key)
    print(f"removed {len(keys)} keys from {store.url}")
    return EXIT_OK
