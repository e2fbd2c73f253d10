//! GPUStack's tunnel messages as a GPUStack worker's tunnel client sends them
//! (`tunnel::gpustack_message::Message::decode`). Invariants: no panic; a message read is
//! written back to bytes that read as the same message, and to the input itself unless the
//! input left out an optional error length.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tunnel::gpustack_message::Message;

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    let Ok(msg) = Message::decode(&input) else {
        return;
    };
    let written = msg.encode().expect("a message read can be written");
    assert_eq!(Message::decode(&written).as_ref(), Ok(&msg));
    if written != input {
        // Only a missing trailing error length (read as "no error") may differ.
        assert_eq!(written.len(), input.len() + 1);
        assert_eq!(written[..input.len()], input[..]);
        assert_eq!(written[input.len()], 0);
    }
});
