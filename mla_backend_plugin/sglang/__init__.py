"""SGLang integration: registration (register.py), version differences (compat.py), the backend (backend.py).

``register.register`` is the ``sglang.srt.plugins`` entry point. Importing this package, ``register`` or
``compat`` imports neither SGLang nor torch; ``backend`` is imported when SGLang builds the attention backend.
"""
