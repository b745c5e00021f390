"""Exceptions raised by :mod:`lit_roidata.exchange`, all :class:`ExchangeError`s; each
names the channel (run id, rank, name) and, where there is one, the peer."""

from __future__ import annotations

__all__ = ["AlignmentError", "ChannelBusyError", "ChannelClosedError", "ExchangeError",
           "ExchangeStateLostError", "ExchangeTimeoutError", "LeaseLostError", "MessageAuthError",
           "PeerDeadError", "SequenceError", "WireFormatError"]


class ExchangeError(RuntimeError):
    """Base class of every error raised by the blob exchange."""


class WireFormatError(ExchangeError, ValueError):
    """A payload cannot be encoded (unsupported dtype, bad meta) or is corrupt on receipt."""


class MessageAuthError(WireFormatError):
    """A message failed authentication (HMAC missing or wrong): forged or altered."""


class ExchangeTimeoutError(ExchangeError, TimeoutError):
    """A bounded wait (``get`` or a ``put`` waiting for an acknowledgement) ran out."""


class PeerDeadError(ExchangeError):
    """The peer's lease expired or its process no longer exists."""


class ChannelClosedError(ExchangeError):
    """The peer closed the channel cleanly, or this end was closed / stopped."""


class ChannelBusyError(ExchangeError):
    """A second live producer (or consumer) tried to open the same channel."""


class LeaseLostError(ExchangeError):
    """This end's ownership lease was taken over (it stalled past the lease TTL)."""


class SequenceError(ExchangeError):
    """A message arrived out of order, duplicated, or with a gap."""


class ExchangeStateLostError(ExchangeError):
    """The backend lost this run's state (memcached restart or eviction)."""


class AlignmentError(ExchangeError, ValueError):
    """A message's alignment metadata differs from the consumer's own."""
