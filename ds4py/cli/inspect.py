"""`python -m ds4py inspect MODEL.gguf`: model shape, tensor counts and sizes per type, largest tensors."""

from __future__ import annotations

import argparse
import os

from ds4py.cli._options import add_engram_dir

NAME = "inspect"
HELP = "show a GGUF's model shape, tensor types and sizes"

SHAPE_KEYS = [  # (label, metadata key without the architecture prefix)
    ("layers", "block_count"), ("hidden", "embedding_length"), ("vocab", "vocab_size"),
    ("heads", "attention.head_count"), ("head dim", "attention.key_length"), ("rope dims", "rope.dimension_count"),
    ("q lora rank", "attention.q_lora_rank"), ("output groups x rank", None),
    ("experts (used / shared)", None), ("expert FFN", "expert_feed_forward_length"),
    ("hash-routed layers", "hash_layer_count"), ("sliding window", "attention.sliding_window"),
    ("indexer heads / dim / top-k", None), ("compress ratios", "attention.compress_ratios"),
    ("context", "context_length"), ("hyper-connections", "hyper_connection.count"),
    ("rms eps", "attention.layer_norm_rms_epsilon"),
]
V41_KEYS = [  # V4.1 only (docs/v41.md)
    ("kv source layers", "attention.kv_source_layers"), ("index source layers", "attention.indexer.source_layers"),
    ("candidate source layer", "attention.indexer.candidate_source_layer"),
    ("candidate blocks x size", None), ("gate temperature", "expert_gating_temperature"),
    ("Engram layers", "engram.layer_ids"), ("Engram table rows", "engram.table_rows"),
    ("Engram n-gram / heads / row", None), ("Engram tables folder", "engram.source_dir"),
    ("DSpark stages x block", None), ("DSpark target layers", "dspark.target_layers"),
]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.gguf", help="a GGUF file, or the name of a model `ds4py pull` fetched")
    p.add_argument("--top", type=int, default=8, help="how many of the largest tensors to list (default 8)")
    p.add_argument("--verify", action="store_true",
                   help="also check the model: metadata, tensor shapes and types, the load-time value checks, and "
                        "every tensor's checksum (reads the whole file); V4.1: the Engram tables too; a pulled file: "
                        "first the sha256 of the whole file against the Hub's")
    add_engram_dir(p)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ds4py.gguf import GGUFFile
    from ds4py.quant import vq

    hub_checked = False
    if args.verify:
        hub_checked = verify_pulled(args)
    elif not os.path.exists(args.model):
        args.model = pulled_path(args.model)
    f = GGUFFile(args.model)
    arch = f.meta("general.architecture", "?")
    A = arch + "."

    def m(key, default="?"):
        return f.meta(A + key, default)

    print(f"{args.model}: GGUF v{f.version}, architecture {arch}, name {f.meta('general.name', '?')!s}, "
          f"{human(f.file_size)}")
    values = {
        "output groups x rank": f"{m('attention.output_group_count')} x {m('attention.output_lora_rank')}",
        "experts (used / shared)": f"{m('expert_count')} ({m('expert_used_count')} / {m('expert_shared_count')})",
        "indexer heads / dim / top-k": f"{m('attention.indexer.head_count')} / {m('attention.indexer.key_length')}"
                                       f" / {m('attention.indexer.top_k')}",
        "candidate blocks x size": f"{m('attention.indexer.candidate_top_k')} x "
                                   f"{m('attention.indexer.candidate_block_size')}",
        "DSpark stages x block": (f"{m('dspark.stage_count')} x {m('dspark.block_size')} (rank "
                                  f"{m('dspark.markov_rank')}, experts {m('dspark.expert_used_count')} of "
                                  f"{m('dspark.expert_count')})" if f.has(A + "dspark.stage_count") else "none"),
        "Engram n-gram / heads / row": f"{m('engram.max_ngram_size')} / {m('engram.head_count')} / "
                                       f"{m('engram.key_length')}",
    }
    print("shape:")
    from ds4py.config import ARCH_V41

    for label, key in SHAPE_KEYS + (V41_KEYS if arch == ARCH_V41 else []):
        if key == "hash_layer_count" and arch == ARCH_V41:
            continue
        v = values.get(label) if key is None else m(key)
        if isinstance(v, list):
            v = ",".join(str(x) for x in v)
        elif isinstance(v, float):
            v = f"{v:g}"
        print(f"  {label:<28s} {v}")
    if f.has("tokenizer.ggml.tokens"):
        def count(key):
            v = f.meta(key, [])
            return len(v) if isinstance(v, list) else "?"
        print(f"  {'tokenizer':<28s} {f.meta('tokenizer.ggml.model', '?')} / {f.meta('tokenizer.ggml.pre', '?')}, "
              f"{count('tokenizer.ggml.tokens')} tokens, {count('tokenizer.ggml.merges')} merges")
    else:
        print(f"  {'tokenizer':<28s} none")

    tensors = list(f.tensors.values())
    total = f.tensor_bytes()
    print(f"tensors: {len(tensors)}, {human(total)} ({total} bytes)")
    by_type: dict[str, list[int]] = {}
    vq_roles = vq.tensor_roles(f)          # VQ-8 tensors count as one type: weights held, overhead included
    for t in tensors:
        label, ne = vq_roles.get(t.name, (t.qtype.name, int(np.prod(t.shape, dtype=np.int64))))
        c = by_type.setdefault(label, [0, 0, 0])
        c[0] += 1
        c[1] += t.nbytes
        c[2] += ne
    print(f"  {'type':<8s} {'count':>6s} {'bytes':>12s} {'params':>14s} {'bits/weight':>11s}")
    for name, (n, nb, ne) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<8s} {n:>6d} {human(nb):>12s} {ne:>14,d} {8 * nb / max(ne, 1):>11.2f}")
    print(f"largest {min(args.top, len(tensors))}:")
    for t in sorted(tensors, key=lambda t: -t.nbytes)[: args.top]:
        print(f"  {t.name:<40s} {t.qtype.name:<8s} ne={list(t.ne)} {human(t.nbytes)}")
    if args.verify:
        verify(f, hub_checked)
        verify_engram(f, args.engram_dir)
    return 0


def pulled_path(name: str) -> str:
    """A pulled model's file by its name (the path itself when it is not one)."""
    from ds4py import hub

    m = hub.load_registry().get(name)
    return m.files[0].path if m is not None and m.files and m.kind != hub.CHECKPOINT else name


def verify_pulled(args: argparse.Namespace) -> bool:
    """A file `ds4py pull` fetched: its whole-file checksum against the one the Hub published (before anything
    parses it: a truncated file is named as such). True when it was one and it matched."""
    import time

    from ds4py import hub
    from ds4py.errors import Ds4Error
    from ds4py.progress import Transfer

    if not os.path.exists(args.model):
        args.model = pulled_path(args.model)
    found = hub.pulled_file(args.model)
    if found is None:
        return False
    name, rec = found
    t0 = time.perf_counter()
    progress = Transfer(f"verify: {rec.checksum.split(':')[0]}", rec.size)
    problem = hub.verify_file(rec, progress.update)
    progress.close()
    if problem is not None:
        raise Ds4Error(f"{problem}; `ds4py pull {name} --force` fetches it again")
    print(f"verify: OK: the whole file's {rec.checksum.split(':')[0]} matches the Hub's for {name} "
          f"({rec.size / 1e9:.2f} GB read in {time.perf_counter() - t0:.1f} s)")
    return True


def verify_engram(f, engram_dir: str | None) -> None:
    """V4.1: the Engram token map from the vocabulary and the tables in their shards (EngramError otherwise)."""
    from ds4py import engram
    from ds4py.config import ModelConfig

    cfg = ModelConfig.from_gguf(f, validate=False)
    if not cfg.engram_layers:
        return
    engram.NgramHasher(cfg, *engram.gguf_vocabulary(f), f.path)
    dir_key, digest_key = engram.meta_keys(cfg.arch)
    folder = engram_dir if engram_dir is not None else f.meta(dir_key, None)
    t = engram.EngramTables.open(cfg, folder, f.meta(digest_key, None), f.path)
    print(f"verify: OK: the vocabulary compresses to {cfg.engram_compressed_vocab} Engram ids; "
          f"{len(t.tables)} Engram tables in {folder} are the ones the model was converted with")


def verify(f, hub_checked: bool = False) -> None:
    """Everything a load checks, then every checksum. Raises the first problem as a Ds4Error (one line).
    hub_checked: the whole file already matched the Hub's sha256, which stands in for missing ds4py checksums."""
    import time

    from ds4py import checksum
    from ds4py.config import ModelConfig
    from ds4py.errors import GGUFError

    ModelConfig.from_gguf(f)                      # metadata types and ranges, tensor schema, sampled values
    if checksum.stored_digests(f) is None and hub_checked:
        print("verify: OK: metadata, tensor layout and sampled values are valid; the file carries no ds4py "
              "checksums: the Hub's sha256 above covers its bytes")
        return
    if checksum.stored_digests(f) is None:
        raise GGUFError(f"{f.path}: the file carries no checksums ({checksum.KEY}; written by ds4py convert and "
                        f"make-tiny): its structure and sampled values are fine, its contents cannot be verified")
    t0 = time.perf_counter()
    meta = checksum.verify_metadata(f)
    n, nbytes = checksum.verify(f)
    if not f.has("tokenizer.ggml.tokens"):       # run, chat and serve refuse it: so does the check
        raise GGUFError(f"{f.path}: the weights are valid, but the file has no tokenizer (tokenizer.ggml.*), which "
                        f"run, chat and serve need; convert again with --tokenizer tokenizer.json")
    print(f"verify: OK: metadata, tensor layout and sampled values are valid; "
          f"{'the metadata checksum and ' if meta else ''}{n} tensor checksums match "
          f"({human(nbytes)} read in {time.perf_counter() - t0:.1f} s)")
