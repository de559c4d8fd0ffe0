"""torch.hub entry points: one per registered zoo model, named as in ``zoo.list_models()``.

    model = torch.hub.load("OWNER/zoo", "hybrid_tiny", pretrained=True)   # a GitHub repository, or
    model = torch.hub.load("path/to/zoo", "hybrid_tiny", source="local", pretrained=True)

Each takes the keyword arguments of ``zoo.create_model`` (``num_classes``, ``img_size``, ...); ``pretrained=True``
loads the CIFAR-10 weights the zoo ships (``zoo.models.shipped_models()``)."""

import zoo

dependencies = ["torch", "torchvision", "timm", "einops", "safetensors"]  # torch.hub checks that these import


def _entrypoint(name: str):
    def load(pretrained: bool = False, **kwargs):
        return zoo.create_model(name, pretrained=pretrained, **kwargs)

    load.__name__ = load.__qualname__ = name
    load.__doc__ = f"zoo.create_model({name!r}, pretrained=pretrained, **kwargs)"
    return load


globals().update({name: _entrypoint(name) for name in zoo.list_models()})
