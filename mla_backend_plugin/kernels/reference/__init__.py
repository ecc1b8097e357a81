from mla_backend_plugin.kernels.reference.torch_ref import mla_decode_reference

__all__ = ["mla_decode_reference"]
