"""nasdiag: second-order and gradient-attribution diagnostics for differentiable NAS supernets.

Data flows one way: supernet -> probe (hooks) -> primitives (cost, hessian, regret)
-> search methods -> recorder -> plots.
"""

__version__ = "0.1.0"

__all__ = ["attach", "__version__"]


def __getattr__(name):
    # Lazy so that `import nasdiag` stays cheap and primitives can be imported on their own.
    if name == "attach":
        from nasdiag.probe import attach

        return attach
    raise AttributeError(f"module 'nasdiag' has no attribute {name!r}")


def __dir__():
    # `attach` is imported on first use: list it, as `dir()` and tab completion would without the laziness
    return sorted(set(globals()) | set(__all__))
