"""vLLM integration: registration (register.py), version differences (compat.py), backend classes (backend.py).

Nothing here is imported until vLLM loads the plugin (register.py) or resolves the backend's class path
(backend.py), so importing ``mla_backend_plugin`` never imports vLLM.
"""
