"""The Hugging Face architectures of the shared decoder, one `Arch` per
`model_type`, in the order export tries them when a config names none (the
simplest first; the mixtures of experts last)."""

from . import gemma, granite, llama, moe, olmo2, phi3, qwen3, starcoder2
from ._common import Arch as Arch, HFConfigError as HFConfigError, Reader as Reader


ARCHS: dict[str, Arch] = {
    a.model_type: a
    for module in (llama, qwen3, gemma, phi3, olmo2, granite, starcoder2, moe)
    for a in module.ARCHS
}
