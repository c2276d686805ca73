"""The exception classes of the drop-in API (``functional``, ``nn``).

torch's batch norm raises ``RuntimeError`` for what this library reports as
``ValueError`` (shapes: a ``running_mean``, ``running_var``, ``weight`` or
``bias`` of the wrong size) or ``TypeError`` (dtypes). So that code written
for torch (``except RuntimeError``) and code written for this library's
documented classes (``except ValueError`` / ``except TypeError``) both catch
them, the drop-in entry points re-raise those errors as
:class:`BatchNormValueError` and :class:`BatchNormTypeError`, which derive
from both, with the same message and traceback. The operators
(``torch_bn_grad.batch_norm_forward`` and the others) raise plain
``ValueError`` / ``TypeError``.

The re-raise is an ``except`` clause around the entry point's body: nothing
runs unless an error is raised.
"""

from __future__ import annotations

__all__ = ["BatchNormValueError", "BatchNormTypeError"]


class BatchNormValueError(ValueError, RuntimeError):
    """A bad value (shape, rank, device, ...): a ``ValueError`` and, as torch raises it, a ``RuntimeError``."""


class BatchNormTypeError(TypeError, RuntimeError):
    """A bad dtype or argument type: a ``TypeError`` and, as torch raises it, a ``RuntimeError``."""


def torch_compatible(error: Exception) -> Exception:
    """``error`` (a ``ValueError`` or ``TypeError``) as the class above that it is, same
    message and traceback; returned as it is if it is a ``RuntimeError`` already.
    Use: ``except (ValueError, TypeError) as e: raise torch_compatible(e) from None``."""
    if isinstance(error, RuntimeError):
        return error
    cls = BatchNormValueError if isinstance(error, ValueError) else BatchNormTypeError
    return cls(*error.args).with_traceback(error.__traceback__)
