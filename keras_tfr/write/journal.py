"""The directory a writer writes to: its file names, what it holds, and the journal.

A conversion's journal (``.keras-tfr-progress.json``) lists its completed shards and
their layout. It is rewritten as each shard completes, before the shard's rename, and
removed once the manifest exists: a directory with a journal and no manifest is an
unfinished conversion, which ``resume=True`` continues from its last shard that passes
its check, and ``overwrite=True`` replaces.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

from keras_tfr import _io
from keras_tfr._version import __version__
from keras_tfr.errors import DatasetExistsError, IncompleteDatasetError, ManifestError
from keras_tfr.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PROGRESS_NAME,
    Manifest,
    ShardInfo,
)
from keras_tfr.write.options import WriteOptions
from keras_tfr.write.plan import Layout

log = logging.getLogger("keras_tfr")

SHARD_FILE = "shard-{:05d}.tfrecord"
SHARD_RE = re.compile(r"^shard-\d{5,}\.tfrecord(\.tmp)?$")


def is_atomic_tmp(name: str) -> bool:
    """A temporary file of `_io.write_atomic` (manifest or journal) left by a killed writer."""
    return name.startswith((MANIFEST_NAME + ".tmp-", PROGRESS_NAME + ".tmp-"))


@dataclasses.dataclass
class DirectoryState:
    """What `inspect_directory` found: files to replace, or a conversion to resume."""

    old_files: list[str] | None = None  # with overwrite=True: removed at the first write
    layout: Layout | None = None
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)


def inspect_directory(directory: str, options: WriteOptions) -> DirectoryState:
    """Checks that `directory` may be written with `options` (the caller holds its lock).

    With ``overwrite=True`` nothing is removed yet (see `remove_old`), so bad input
    leaves the old data intact. Otherwise files left by a killed writer are removed and,
    with ``resume=True``, the journal is read back.
    """
    manifest_path = _io.join(directory, MANIFEST_NAME)
    progress_path = _io.join(directory, PROGRESS_NAME)
    has_manifest = _io.exists(manifest_path)
    has_progress = _io.exists(progress_path)
    if has_manifest and not options.overwrite and options.resume:
        # A conversion interrupted just after it finished (a Ctrl-C at its end) is whole.
        raise DatasetExistsError(
            f"{directory} already holds a complete keras-tfr data set ({MANIFEST_NAME} "
            "exists): its conversion finished, so there is nothing to resume. Read it, or "
            "pass `overwrite=True` to write it again."
        )
    if has_manifest and not options.overwrite:
        raise DatasetExistsError(
            f"{directory} already holds a keras-tfr data set ({MANIFEST_NAME} exists). "
            "Pass `overwrite=True` to replace it, or choose another directory."
        )
    if has_progress and not (options.resume or options.overwrite):
        raise IncompleteDatasetError(
            f"{directory} holds an unfinished conversion. Pass `resume=True` to "
            "continue it from its last complete shard, or `overwrite=True` to start over."
        )
    if options.overwrite:
        return DirectoryState(old_files=_old_files(directory, has_manifest))
    for name in _io.listdir(directory):
        if (name.endswith(".tfrecord.tmp") and SHARD_RE.match(name)) or is_atomic_tmp(name):
            _io.remove(_io.join(directory, name))  # left by a killed writer
    state = DirectoryState()
    if has_progress and options.resume:
        state = load_journal(directory, progress_path, options.shuffle_seed)
    elif options.resume:
        log.info("keras-tfr: nothing to resume in %s; starting a new conversion", directory)
    known = {s.file for s in state.shards}
    stray = [n for n in _io.listdir(directory) if SHARD_RE.match(n) and n not in known]
    if stray and has_progress and options.resume:
        # Beyond the journal (a writer killed between a rename and its journal entry,
        # or shards that failed their check): this conversion's own, rewritten now.
        for name in stray:
            _io.remove(_io.join(directory, name))
        stray = []
    if stray:
        raise IncompleteDatasetError(
            f"{directory} holds shard files that no manifest or journal lists "
            f"({', '.join(sorted(stray)[:5])}). Pass `overwrite=True` to replace them."
        )
    return state


def _old_files(directory: str, has_manifest: bool) -> list[str]:
    names = [n for n in _io.listdir(directory) if SHARD_RE.match(n) or is_atomic_tmp(n)]
    names += [PROGRESS_NAME, MANIFEST_NAME]
    if has_manifest:
        try:  # shards of another writer may have other names: the manifest knows them
            old = Manifest.load(directory, check_files=False)
            names += [s.file for s in old.shards]
        except (ManifestError, OSError):
            pass
    return names


def remove_old(directory: str, old_files: list[str]) -> None:
    """Removes a replaced data set, its manifest first (from then on no reader takes the
    directory for a data set), then an unfinished conversion's journal (from then on no
    resume keeps its shards: a writer killed here leaves stray shards, refused), then
    the shards."""
    first = [MANIFEST_NAME, PROGRESS_NAME]
    for name in [*first, *(n for n in old_files if n not in first)]:
        _io.remove(_io.join(directory, name))


def load_journal(directory: str, path: str, shuffle_seed: int | None) -> DirectoryState:
    """The layout and the shards (those that pass their check) of an unfinished conversion;
    the shards after the first that fails are removed. A ValueError, before any shard is
    read, when it was begun in another order than ``shuffle_seed`` asks for."""
    try:
        journal = json.loads(_io.read_bytes(path).decode("utf-8"))
        if journal.get("format") != FORMAT_NAME or journal.get("format_version") != (
            FORMAT_VERSION
        ):
            raise ValueError("unknown journal format")
        probe = Manifest.from_json(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                **journal["config"],
                "shards": journal["shards"],
            },
            source=path,
        )
        records_per_shard = int(journal["records_per_shard"])
    except (ValueError, KeyError, TypeError) as e:
        raise IncompleteDatasetError(
            f"The journal {path} of the unfinished conversion is damaged ({e}); "
            "start over with `overwrite=True`."
        ) from e
    _check_same_order(directory, probe.shuffle_seed, shuffle_seed)
    probe.directory = directory
    kept = _verified_prefix(probe)
    for shard in probe.shards[len(kept) :]:
        _io.remove(_io.join(directory, shard.file))
    layout = Layout(
        structure=probe.structure,
        specs=sorted(probe.features, key=lambda s: s.key),
        samples_per_record=probe.samples_per_record,
        record_bytes=probe.record_bytes,
        records_per_shard=records_per_shard,
        compression=probe.compression,
        lattice=probe.lattice,
        shuffle_seed=probe.shuffle_seed,
        key_order=probe.key_order,
    )
    log.info(
        "keras-tfr: resuming %s after %d complete shards (%d samples)",
        directory,
        len(kept),
        sum(s.samples for s in kept),
    )
    return DirectoryState(layout=layout, shards=kept)


def _check_same_order(directory: str, began: int | None, given: int | None) -> None:
    """Refuses to resume a conversion written in another order than the one asked for:
    its shards hold the samples in the order of ``shuffle_seed=began``, so the rest
    written in another order would repeat some samples and leave out others, under a
    manifest naming the journal's seed."""
    if began == given:
        return
    # Worded so that the command line's flags replace the arguments (`keras_tfr.cli`):
    # "shuffle_seed=3" -> "--shuffle-seed 3", "shuffle_seed=None" -> "no --shuffle-seed".
    fix = f"Resume it with shuffle_seed={began} and the same input"
    if began is not None:
        fix = (
            f"Resume it with shuffle_seed={began} and the same arrays (not an iterable "
            "of batches, nor the writer's `write`: they write in the order given)"
        )
    raise ValueError(
        f"The unfinished conversion in {directory} was begun with shuffle_seed={began}: "
        f"its shards hold the samples in that order. {fix}, or start over with "
        f"`overwrite=True`. Received: shuffle_seed={given}"
    )


def _verified_prefix(probe: Manifest) -> list[ShardInfo]:
    from keras_tfr.verifier import verify_shard

    kept: list[ShardInfo] = []
    for shard in probe.shards:
        problems = verify_shard(probe, shard)
        if problems:
            log.warning("keras-tfr: not resuming from %s: %s", shard.file, "; ".join(problems))
            break
        kept.append(shard)
    return kept


def write_journal(
    directory: str, layout: Layout, shards: list[ShardInfo], encoded: list[str] | None = None
) -> None:
    """Records the completed `shards` (not synced: `resume` checks every shard it keeps).

    ``encoded``: the caller's list of the shards' entries encoded so far (the journal is
    rewritten, whole, after every shard; the caller drops the entries of shards it takes
    back). Encoding every shard's entry again each time, indented, made writing
    quadratic: 2,000 shards took 10.1 s, 1,000 2.6 s. Now each entry is encoded once
    and the journal is one compact line.
    """
    if encoded is None:
        encoded = []
    del encoded[len(shards) :]
    encoded.extend(_shard_json(s) for s in shards[len(encoded) :])
    head = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "writer_version": __version__,
        "records_per_shard": layout.records_per_shard,
        "config": layout.config(),
    }
    text = json.dumps(head, separators=(",", ":"))[:-1]  # without its closing brace
    data = f'{text},"shards":[{",".join(encoded)}]}}\n'.encode()
    _io.write_atomic(_io.join(directory, PROGRESS_NAME), data, durable=False)


def _shard_json(shard: ShardInfo) -> str:
    return json.dumps(shard.to_json(), separators=(",", ":"))
