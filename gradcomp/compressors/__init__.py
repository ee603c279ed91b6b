"""One module per method; importing this package registers them all."""
from . import allreduce, dgc, diloco, onebit, powersgd, sparseloco, terngrad, threshold, topk  # noqa: F401  (registration)
from .base import METHODS, BucketContext, Compressor, MethodSpec, ParamSlice, register_method

__all__ = ["METHODS", "BucketContext", "Compressor", "MethodSpec", "ParamSlice", "register_method"]
