"""The harness's models in a few words each (no torch here: ``--model``'s help reads it
before anything heavy is imported; :mod:`.models` builds them)."""

DESCRIPTIONS = {
    "resnet_small": "a small CIFAR ResNet, 3 stages of one block, widths 16-64",
    "resnet18": "CIFAR ResNet-18",
    "resnet18_narrow": "CIFAR ResNet-18 at width 16",
    "gpt": "a character-level GPT, 4 layers, width 128, AdamW",
    "gpt_tiny": "a character-level GPT, 2 layers, width 64, AdamW",
    "gpt2_small": "GPT-2 small's shapes, too large to train on a CPU",
}


def help_text(default: str) -> str:
    """``--model``'s help: every model, what it is, the default."""
    return "one of: " + "; ".join(f"{k}: {v}" for k, v in DESCRIPTIONS.items()) + (
        f". Default {default}")
