"""Built-in search methods, one module each; every module here is imported by the registry."""
