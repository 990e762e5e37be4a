"""Files that eqtrain writes where others may read or keep files: the mode a new
file gets under the user's umask, the durable rename of a finished file, and
which files make up an export directory (anything else there is a user's and
must survive replacing it)."""

import os
import re


def umask() -> int:
    """The process's umask, read without changing it (Linux `/proc`); elsewhere
    set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_default_mode(path: str | os.PathLike[str]) -> None:
    """Give `path` the mode a plain `open()` (or `mkdir`) would have: writers that
    create a private temporary and rename it (`tempfile`, the safetensors package)
    leave 0600/0700, so others on a shared machine could not read an export."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())


def replace_durably(
    tmp: str | os.PathLike[str], path: str | os.PathLike[str], *, sync_dir: bool = False
) -> None:
    """Flush `tmp`'s bytes to the disk and rename it onto `path` (atomic: a
    reader sees the old file or the new one, whole); with `sync_dir`, the rename
    is flushed too, so it survives a power cut."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_EXPORT_NAMES = frozenset(
    {
        # what eqtrain's exports write
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "adapter_config.json",
        "adapter_model.safetensors",
        # what `save_pretrained` of transformers/PEFT also writes
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "chat_template.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "adapter_model.bin",
    }
)
_EXPORT_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")
# transformers 5's folder of named chat templates (`<name>.jinja` files only),
# which exports write beside `chat_template.jinja`
TEMPLATE_DIR = "additional_chat_templates"


def foreign_files(directory: str | os.PathLike[str]) -> list[str]:
    """The entries of `directory` that are not part of an eqtrain or Hugging Face
    export (a user's notes, a model card, subdirectories other than a
    `TEMPLATE_DIR` of `.jinja` files only): what replacing the directory with a
    new export would delete. Sorted."""
    out = []
    for entry in os.scandir(directory):
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            known = name == TEMPLATE_DIR and is_template_dir(entry.path)
        else:
            known = name in _EXPORT_NAMES or bool(_EXPORT_SHARD.fullmatch(name))
        if not known:
            out.append(name + ("/" if entry.is_dir() else ""))
    return sorted(out)


def is_template_dir(path: str | os.PathLike[str]) -> bool:
    """Whether the directory `path` holds only `<name>.jinja` files (no links,
    no subdirectories): chat templates, as an export writes them."""
    return all(
        entry.name.endswith(".jinja") and entry.is_file(follow_symlinks=False)
        for entry in os.scandir(path)
    )


def describe_names(names: list[str], limit: int = 5) -> str:
    """`a, b and 3 more`."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
