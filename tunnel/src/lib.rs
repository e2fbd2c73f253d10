//! faden tunnel: yamux over one outbound WebSocket per worker (filled in by the tunnel issue).
