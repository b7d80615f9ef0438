"""The sharded format (train.py --parallel=fsdp) with torch.distributed.checkpoint (DCP).

<out_dir>/ckpt.dcp is a link to the newest published `ckpt.dcp.<step>` folder: DCP's files, one per
rank, with the model's and the optimizer's items (SHARDED_ITEMS), and run.pt (a one-file
checkpoint) with the other items. Every file carries its digest record (checkpoint/files.py), each
rank's shards hashed as its writer writes them; a folder is complete once it holds run.pt and DCP's
index, .metadata (written last, its record before it). Saves may be asynchronous; the link is
swapped atomically once a save is complete; once a start has decided, prepare() repairs what a copy
or a killed save left. A sharded checkpoint loads on any number of processes, or into a plain model
in one process; its pickled index is read with an unpickler that builds only DCP's own metadata
classes.

DCP is imported in the functions only: it is slow to import, and sampling, export, analysis and
unsharded runs never need it.
"""

import contextlib
import functools
import io
import os
import pathlib
import pickle
import re
import shutil
import warnings

import torch
import torch.distributed as dist

from checkpoint.files import (DIGEST_SUFFIX, Damaged, DigestingWriter, Found, fsync_dir, load_checkpoint, read_record,
                              record_path, save_checkpoint, set_aside, verify_file, write_record)

SHARDED_NAME = "ckpt.dcp"  # the link to the newest complete sharded checkpoint in an out_dir
RUN_STATE_FILE = "run.pt"  # a sharded checkpoint's items besides the sharded ones
SHARDED_ITEMS = ("model", "optimizer")  # the items DCP writes, each rank its shards
STAGER_REUSE_TORCH = (2, 13)  # before it, DefaultStager closes itself after one stage (torch 2.11 does)
SHARDED_FOLDER = re.compile(re.escape(SHARDED_NAME) + r"\.(\d+)(?:-(\d+))?")


def sharded_path(out_dir):
    return os.path.join(out_dir, SHARDED_NAME)


class ShardedStorage:
    """The sharded checkpoints of out_dir: the link ckpt.dcp and its ckpt.dcp.<step> folders.
    Asynchronous saves (asynchronous=True) stage the shards into CPU memory with DCP's stager and
    write them in a background thread whose collectives go through `group`, a gloo group apart from
    training's."""
    parallel = "fsdp"

    def __init__(self, out_dir, device=None, asynchronous=False, group=None):
        self.out_dir, self.device, self.group = out_dir, device, group
        self.path = sharded_path(out_dir)
        self.stager = new_stager(device) if asynchronous else None

    def found(self):
        """Every complete sharded checkpoint in out_dir, newest first: the linked folder named by
        the link, ckpt.dcp.<step> folders, and a ckpt.dcp that a copy made a folder."""
        linked = os.path.basename(os.readlink(self.path)) if os.path.islink(self.path) else None
        found = [Found(self.path if name == linked else os.path.join(self.out_dir, name), int(m[1]))
                 for m, name in ((SHARDED_FOLDER.fullmatch(name), name) for name in sharded_folders(self.out_dir))
                 if is_complete_sharded(os.path.join(self.out_dir, name))]
        if os.path.isdir(self.path) and not os.path.islink(self.path) and is_complete_sharded(self.path):
            found.append(Found(self.path, folder_step(self.path)))
        return sorted(found, key=lambda f: -1 if f.step is None else f.step, reverse=True)

    def read(self, found, verify=True):
        """(run.pt's items, whether every file's digests verified); Damaged when it cannot be used."""
        if not os.path.isfile(os.path.join(found.path, ".metadata")):
            raise Damaged(f"{found.path} is truncated, corrupt or not a sharded checkpoint (no .metadata)")
        verified = verify and verify_folder(found.path)
        ckpt = load_checkpoint(os.path.join(found.path, RUN_STATE_FILE), required=("model_args", "config", "step"),
                               verify=False)
        return ckpt, verified

    def load(self, found, ckpt, states):
        """The items to continue from: run.pt's, and the sharded ones read by DCP into the states'
        own (each rank its shards; DCP reshards to any world size)."""
        template = {key: states[key].state_dict()[key] for key in SHARDED_ITEMS}
        load_dcp(found.path, template)
        return dict(ckpt, **template)

    def start_save(self, items, step, keep, saved_step, master):
        """Start a save; returns the ShardedSave that publishes it. Every rank calls it: rank 0 writes
        run.pt (every item but SHARDED_ITEMS) into a new folder `ckpt.dcp.<step>`, then each rank
        writes its own shards there. With a stager the save is asynchronous: the stager copies the
        shards into CPU memory here, and a background thread writes them; the model may train on."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        if self.stager is not None and torch.__version__ < STAGER_REUSE_TORCH:
            self.stager.close()
            self.stager = new_stager(self.device)
        names = [_fresh_folder_name(self.out_dir, step) if master else None]
        dist.broadcast_object_list(names)
        folder, error = os.path.join(self.out_dir, names[0]), None
        if master:
            try:
                os.makedirs(folder)
                save_checkpoint(os.path.join(folder, RUN_STATE_FILE),
                                {k: v for k, v in items.items() if k not in SHARDED_ITEMS})
            except Exception as e:  # torch's writer raises RuntimeError as well as OSError
                error = e
        started = [error is None]
        dist.broadcast_object_list(started)  # no rank goes into DCP's collectives alone
        save = ShardedSave(self.out_dir, names[0], step, keep)
        if not started[0]:
            save.remove_folder()
            raise error if error is not None else OSError("rank 0 could not start the checkpoint")
        try:
            state = {key: items[key] for key in SHARDED_ITEMS}
            writer = _digesting_writer_class()(folder, step)
            if self.stager is not None:
                save.future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                             async_stager=self.stager)
            else:
                try:
                    dcp.save(state, storage_writer=writer)
                except CheckpointException as e:  # a BaseException: raise the first rank's own exception instead
                    raise first_exception(e) from None
        except BaseException:
            save.remove_folder()
            raise
        return save

    def prepare(self, chosen, skipped, keep):
        """Rank 0, once a start has decided (chosen: the Found it resumes, or None): the damaged
        checkpoints it skipped set aside; a ckpt.dcp that a copy made a folder (`cp -rL`) becomes a
        ckpt.dcp.<step> folder; the link names the chosen folder; the folders of killed or failed
        saves and those beyond the `keep` newest removed. Returns what it did, as lines."""
        lines = [f"note: set {damaged.path} aside as {set_aside(_folder_of(damaged.path))}" for damaged, _ in skipped]
        copied = os.path.isdir(self.path) and not os.path.islink(self.path)
        if copied:
            step = folder_step(self.path)
            moved = os.path.join(self.out_dir, _fresh_folder_name(self.out_dir, step))
            os.rename(self.path, moved)
            chosen = Found(moved, step) if chosen is not None and chosen.path == self.path else chosen
            lines.append(f"{self.path} was a folder, not a link (a copy that followed links): its checkpoint of step "
                         f"{step} is {'linked again' if chosen is not None and chosen.path == moved else 'kept'}")
        if chosen is not None:
            linked = os.path.basename(os.readlink(self.path)) if os.path.islink(self.path) else None
            name = os.path.basename(_folder_of(chosen.path))
            if name != linked:
                if not (skipped or copied):
                    lines.append(f"using {name}, the newest complete checkpoint in {self.out_dir}, which a killed save "
                                 f"left unlinked")
                _point_link(self.out_dir, name)
        removed = remove_stale_sharded(self.out_dir, keep)
        if removed:
            lines.append(f"removed {removed} checkpoint folder(s) in {self.out_dir} beyond the {keep} kept, left by "
                         f"saves that were killed, failed or replaced")
        return lines

    def close(self):
        if self.stager is not None:
            self.stager.close()


def _folder_of(path):
    """The folder a sharded checkpoint's path names (the link's target for the link)."""
    return os.path.join(os.path.dirname(path), os.readlink(path)) if os.path.islink(path) else path


def folder_step(folder):
    """The step of a sharded checkpoint folder: its run.pt's digest record says it, else run.pt."""
    run_state = os.path.join(folder, RUN_STATE_FILE)
    with contextlib.suppress(Damaged):
        saves = read_record(run_state)
        if saves is not None and isinstance(saves[-1].get("step"), int):
            return saves[-1]["step"]
        return load_checkpoint(run_state, required=("step",), verify=False)["step"]
    return None


def verify_folder(folder):
    """Whether every file of a sharded checkpoint matches its digest record: True, or False for a
    folder written before checkpoints carried digests (no record at all); Damaged, naming the
    file, when one does not, or has no record, or is missing."""
    names = os.listdir(folder)
    recorded = {name[:-len(DIGEST_SUFFIX)] for name in names if name.endswith(DIGEST_SUFFIX)}
    recorded = {name for name in recorded if not name.endswith(".tmp")}
    if not recorded:
        return False
    files = {name for name in names if name.endswith(".distcp") or name in (".metadata", RUN_STATE_FILE)}
    for name in sorted(files | recorded):
        if name not in recorded:
            raise Damaged(f"{os.path.join(folder, name)} is damaged: it has no digest record")
        verify_file(os.path.join(folder, name))
    return True


@functools.cache
def _digesting_writer_class():
    """DCP's FileSystemWriter whose files are hashed as they are written and recorded as the save of
    `step` (each rank its own shards; rank 0 also DCP's index, whose record is renamed into place
    before the index). Built on first use, as DCP is imported then."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class DigestingFileSystem(FileSystem):
        def __init__(self, step):
            super().__init__()
            self.step = step

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if mode != "wb":
                    yield stream
                    return
                writer = DigestingWriter(stream)
                yield writer
            write_record(path, [writer.save(self.step)])

        def rename(self, path, new_path):
            if os.path.exists(record_path(path)):  # the record first: a complete folder's files all have one
                os.replace(record_path(path), record_path(new_path))
            super().rename(path, new_path)

    class DigestingFileSystemWriter(dcp.FileSystemWriter):
        def __init__(self, folder, step):
            super().__init__(folder, sync_files=True)
            self.fs = DigestingFileSystem(step)

    return DigestingFileSystemWriter


def new_stager(device):
    """DCP's stager for asynchronous saves: it keeps the CPU copy of each tensor from one save to
    the next (allocating it anew each time costs more than the copy), pinned for a GPU. Before
    STAGER_REUSE_TORCH a stager serves one save: start_save makes one per save there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    # by position, as async_save builds its own (the last field's name differs between torch versions):
    # pinned memory, shared memory, staging in a thread, non-blocking copies
    return DefaultStager(StagingOptions(device.type == "cuda", False, False, False))


class ShardedSave:
    """A sharded save that has started: `future` (None when it was written in the call) says when
    every rank's shards and DCP's index, .metadata, are on disk; finish() waits for it, then rank 0
    points the link ckpt.dcp at the folder with an atomic rename and keeps the newest `keep`
    complete folders. A crash or a failure at any point before the rename leaves the link on the
    previous complete checkpoint; what the failed save wrote is removed."""

    def __init__(self, out_dir, name, step, keep, future=None):
        self.out_dir, self.name, self.step, self.keep, self.future = out_dir, name, step, keep, future

    def done(self):
        return self.future is None or self.future.done()

    def finish(self):
        """Wait for the write, then publish it; raises the first rank's exception if it failed."""
        from torch.distributed.checkpoint.api import CheckpointException
        linked = False
        try:
            if self.future is not None:
                try:
                    self.future.result()
                except CheckpointException as e:  # a BaseException: raise the first rank's own exception instead
                    raise first_exception(e) from None
            if dist.get_rank() == 0:
                fsync_dir(os.path.join(self.out_dir, self.name))  # .metadata's rename made durable
                _point_link(self.out_dir, self.name)
                linked = True
                remove_stale_sharded(self.out_dir, self.keep)
        except BaseException:
            if not linked:
                self.remove_folder()
            raise

    def remove_folder(self):
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(self.out_dir, self.name), ignore_errors=True)


def first_exception(e):
    """The first rank's exception in DCP's CheckpointException (its errno tells a full disk), or
    an OSError with its line."""
    failures = [failure[0] for failure in e.failures.values()]
    if failures and isinstance(failures[0], Exception):
        return failures[0]
    return OSError(first_failure(e))


def first_failure(e):
    """The first rank's exception in DCP's CheckpointException, as one line."""
    failures = list(e.failures.values())
    return one_line(failures[0][0]) if failures else "CheckpointException"


def one_line(e):
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _fresh_folder_name(out_dir, step):
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    name, retry = f"{SHARDED_NAME}.{step}", 1
    while name in names:  # a folder of this step left by an earlier attempt, perhaps the live one
        name, retry = f"{SHARDED_NAME}.{step}-{retry}", retry + 1
    return name


def _point_link(out_dir, name):
    """Make the link ckpt.dcp name `name` (relative, so the run folder can move), atomically."""
    tmp_link = os.path.join(out_dir, f".{SHARDED_NAME}.link.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp_link)
    os.symlink(name, tmp_link)
    os.replace(tmp_link, sharded_path(out_dir))
    fsync_dir(out_dir)


def sharded_folders(out_dir):
    """The ckpt.dcp.<step>[-<retry>] folders of out_dir, oldest first (by step, then retry)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    matches = [m for m in map(SHARDED_FOLDER.fullmatch, names) if m and os.path.isdir(os.path.join(out_dir, m[0]))]
    return [m[0] for m in sorted(matches, key=lambda m: (int(m[1]), int(m[2] or 0)))]


def is_complete_sharded(folder):
    """Whether a sharded checkpoint folder holds its run.pt and DCP's index (written last)."""
    return all(os.path.isfile(os.path.join(folder, name)) for name in (RUN_STATE_FILE, ".metadata"))


def remove_stale_sharded(out_dir, keep=1):
    """Delete the ckpt.dcp.* folders beyond the link's and the keep - 1 complete ones before it:
    replaced checkpoints and what a killed or failed save wrote. Returns the number removed."""
    live = os.path.basename(os.path.realpath(sharded_path(out_dir)))
    folders = sharded_folders(out_dir)
    older = folders[:folders.index(live)] if live in folders else folders
    complete_older = [name for name in older if is_complete_sharded(os.path.join(out_dir, name))]
    kept = {live, *complete_older[max(len(complete_older) - (keep - 1), 0):]}
    stale = [name for name in folders if name not in kept]
    for name in stale:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return len(stale)


def load_sharded_run(path):
    """The run state of the sharded checkpoint folder `path` (its items but the sharded ones),
    run.pt verified; raises Damaged with one line."""
    if not os.path.isdir(path):
        raise Damaged(f"checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise Damaged(f"{path} is truncated, corrupt or not a sharded checkpoint (no .metadata)")
    return load_checkpoint(os.path.join(path, RUN_STATE_FILE), required=("model_args", "config", "step"))


def load_dcp(path, template):
    """Read the sharded checkpoint folder `path` into template, a dict of its items' state dicts
    (tensors or DTensors of the right shapes, filled in place), on every rank of the process group
    or in one process without one. Raises Damaged with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    reader, planner = _safe_reader_and_planner()
    try:
        with warnings.catch_warnings():  # DCP warns that one process reads it, which is what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=reader(path), planner=planner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        reason = first_failure(e) if isinstance(e, CheckpointException) else one_line(e)
        raise Damaged(f"{path} is truncated, corrupt or not a checkpoint of this model ({reason})") from None


def read_weights(path, module):
    """Read the model weights of the sharded checkpoint folder `path` into a plain module, in one
    process. A sharded model stores each 0-D parameter as the 1-element vector apply_fsdp made of
    it: the module's own are read through such views, which share their storage."""
    template = dict(model={k: v.view(1) if v.dim() == 0 else v for k, v in module.state_dict().items()})
    load_dcp(path, template)
    module.load_state_dict(module.state_dict())  # runs the load hooks: mhclite rebuilds its permutation matrices


def read_model_items(path):
    """The model weights of the sharded checkpoint folder `path` as a dict of plain tensors, shaped
    as saved (0-D parameters as 1-element vectors), without a model: their shapes come from DCP's
    index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader, _ = _safe_reader_and_planner()
    try:
        metadata = reader(path).read_metadata()
    except Exception as e:
        raise Damaged(f"{path} is truncated, corrupt or not a sharded checkpoint ({one_line(e)})") from None
    template = dict(model={key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype)
                           for key, item in metadata.state_dict_metadata.items()
                           if key.startswith("model.") and isinstance(item, TensorStorageMetadata)})
    load_dcp(path, template)
    return template["model"]


@functools.cache
def metadata_classes():
    """The classes a DCP .metadata file is built from (torch 2.13), and nothing else."""
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    classes = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
               for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    classes.update({("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
                    ("torch", "Size"): torch.Size,
                    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                    ("pathlib", "PosixPath"): pathlib.PosixPath})
    return classes


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds DCP's metadata classes, torch's dtypes and layouts, and refuses
    every other global, so a crafted .metadata cannot run code."""

    def find_class(self, module, name):
        if (module, name) in metadata_classes():
            return metadata_classes()[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


@functools.cache
def _safe_reader_and_planner():
    """DCP's FileSystemReader and DefaultLoadPlanner made safe, as (reader class, planner class):
    the reader reads the pickled metadata with MetadataUnpickler instead of pickle.load (the tensors
    it reads already go through torch.load(weights_only=True)); the planner loads the non-tensor
    items (the optimizer's settings) with torch.load(weights_only=True) instead of a plain
    unpickling. Built on first use, as DCP is imported then."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint._traverse import set_element

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                metadata = MetadataUnpickler(io.BytesIO(f.read())).load()
            if not isinstance(metadata, dcp_metadata.Metadata):
                raise pickle.UnpicklingError("the .metadata file holds no DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeFileSystemReader, SafeLoadPlanner
