"""Dispatch tokens to experts and combine expert outputs back, behind one protocol."""

from megamoe_runtime.dispatch.local import LocalDispatcher, LocalHandle
from megamoe_runtime.dispatch.protocol import Dispatcher

__all__ = ["Dispatcher", "LocalDispatcher", "LocalHandle"]
