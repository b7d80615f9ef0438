"""Sharded checkpoints (train.py --parallel=fsdp) with torch.distributed.checkpoint (DCP).

<out_dir>/ckpt.dcp is a link to the newest complete `ckpt.dcp.<step>` folder: DCP's files, one per
rank, with the model and optimizer state ("model", "optimizer"), and run.pt (a one-file checkpoint)
with the rest of the checkpoint's items; a folder is complete once it holds run.pt and DCP's index,
.metadata (written last). Saves may be asynchronous; the link is swapped atomically once a save is
complete; a start repairs what a copy or a killed save left (recover_sharded). A sharded checkpoint
loads on any number of processes, or into a plain model in one process; its pickled index is read
with an unpickler that builds only DCP's own metadata classes.

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

from checkpoint.single_file import CheckpointError, fsync_dir, load_checkpoint, save_checkpoint

SHARDED_NAME = "ckpt.dcp"  # the link to the newest complete sharded checkpoint in an out_dir
RUN_STATE_FILE = "run.pt"  # a sharded checkpoint's items besides the model and optimizer state


def sharded_path(out_dir):
    return os.path.join(out_dir, SHARDED_NAME)


def start_sharded_save(path, model, optimizer, run_state, keep=1, group=None, stager=None):
    """Start a save to the sharded checkpoint `path`; returns the ShardedSave that publishes it.
    Every rank calls it: rank 0 writes run.pt (run_state: a checkpoint dict without model and
    optimizer) into a new folder `ckpt.dcp.<step>`, then each rank writes its own shards of the
    model (sharded by parallelize.apply_fsdp) and of its optimizer there. With a stager (DCP's
    AsyncStager, new_stager) the save is asynchronous: the stager copies the shards into CPU
    memory here, and a background thread writes them, its collectives going through `group` (a
    gloo group apart from training's); the model may train on meanwhile."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out_dir = os.path.dirname(os.path.abspath(path))
    names = [_fresh_folder_name(out_dir, run_state["step"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names)
    folder, error = os.path.join(out_dir, names[0]), None
    if dist.get_rank() == 0:
        try:
            os.makedirs(folder)
            save_checkpoint(os.path.join(folder, RUN_STATE_FILE), run_state)
        except Exception as e:  # torch's writer raises RuntimeError as well as OSError
            error = e
    started = [error is None]
    dist.broadcast_object_list(started)  # no rank goes into DCP's collectives alone
    save = ShardedSave(out_dir, names[0], run_state["step"], keep)
    if not started[0]:
        save.remove_folder()
        raise error if error is not None else OSError("rank 0 could not start the checkpoint")
    try:
        fresh = not optimizer.state
        model_state, optimizer_state = get_state_dict(model, optimizer)
        if fresh:  # get_state_dict built the state with one zero-gradient step: AdamW's state before any step
            for param_state in optimizer.state.values():
                param_state["step"].zero_()
        state = dict(model=model_state, optimizer=optimizer_state)
        writer = dcp.FileSystemWriter(folder, sync_files=True)
        if stager is not None:
            save.future = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=stager)
        else:
            try:
                dcp.save(state, storage_writer=writer)
            except CheckpointException as e:  # a BaseException: raise the first rank's own exception instead
                raise first_exception(e) from None
    except BaseException:
        save.remove_folder()
        raise
    return save


STAGER_REUSE_TORCH = (2, 13)  # before it, DefaultStager closes itself after one stage (torch 2.11 does)


def new_stager(device):
    """DCP's stager for asynchronous saves: it keeps the CPU copy of each tensor from one save to
    the next (allocating it anew each time costs more than the copy), pinned for a GPU. Before
    STAGER_REUSE_TORCH a stager serves one save: the manager makes one per save there."""
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


SHARDED_FOLDER = re.compile(re.escape(SHARDED_NAME) + r"\.(\d+)(?:-(\d+))?")


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


def recover_sharded(out_dir, keep=1):
    """Make out_dir's sharded checkpoints usable again at a start, before anything reads them;
    returns what it did, as lines. A ckpt.dcp that is a folder (a run copied with `cp -rL`, or
    to a filesystem without links) becomes the folder of its step, and the link names it; the
    newest complete ckpt.dcp.<step> folder becomes the linked one (a save killed after its write
    and before the link swap left it unlinked); folders beyond the kept ones are removed."""
    link, lines = sharded_path(out_dir), []
    if os.path.isdir(link) and not os.path.islink(link) and is_complete_sharded(link):
        step = load_checkpoint(os.path.join(link, RUN_STATE_FILE), required=("step",))["step"]
        same = os.path.join(out_dir, f"{SHARDED_NAME}.{step}")
        if is_complete_sharded(same):  # `cp -rL` copied the linked folder twice
            shutil.rmtree(link)
        else:
            os.rename(link, os.path.join(out_dir, _fresh_folder_name(out_dir, step)))
        lines.append(f"{link} was a folder, not a link (a copy that followed links): its checkpoint of step {step} "
                     f"is linked again")
    complete = [name for name in sharded_folders(out_dir) if is_complete_sharded(os.path.join(out_dir, name))]
    if os.path.isdir(link) and not os.path.islink(link):
        return lines  # an incomplete copy: not ours to touch; loading it says what is wrong
    live = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
    if complete and complete[-1] != live:
        if not lines:
            lines.append(f"using {complete[-1]}, the newest complete checkpoint in {out_dir}, which a killed save "
                         f"left unlinked")
        _point_link(out_dir, complete[-1])
    removed = remove_stale_sharded(out_dir, keep) if complete else 0
    if removed:
        lines.append(f"removed {removed} checkpoint folder(s) in {out_dir} beyond the {keep} kept, left by saves "
                     f"that were killed, failed or replaced")
    return lines


def load_sharded_run(path):
    """The run state of the sharded checkpoint folder `path` (its dict without model and
    optimizer); raises CheckpointError with one line."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is truncated, corrupt or not a sharded checkpoint (no .metadata)")
    return load_checkpoint(os.path.join(path, RUN_STATE_FILE), required=("model_args", "config", "step"))


def load_sharded(path, model, optimizer=None):
    """Read the weights (and the optimizer state, if given) of the sharded checkpoint folder `path`
    into model: one sharded by parallelize.apply_fsdp on any number of ranks (DCP reshards), or a
    plain GPT in one process. Raises CheckpointError with one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    reader, planner = _safe_reader_and_planner()
    plain = not any(hasattr(p, "device_mesh") for p in model.parameters())
    if plain:
        # the scalars were saved as the 1-element vectors apply_fsdp made of them: views share storage
        state = dict(model={k: v.view(1) if v.dim() == 0 else v for k, v in model.state_dict().items()})
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer if optimizer is not None else [])
        state = dict(model=model_state) if optimizer is None else dict(model=model_state, optimizer=optimizer_state)
    try:
        with warnings.catch_warnings():  # DCP warns that one process reads it, which is what we ask for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader(path), planner=planner(),
                     no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        reason = first_failure(e) if isinstance(e, CheckpointException) else one_line(e)
        raise CheckpointError(f"{path} is truncated, corrupt or not a checkpoint of this model ({reason})") from None
    if plain:
        model.load_state_dict(model.state_dict())  # runs the load hooks: mhclite rebuilds its permutation matrices
    elif optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})


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
