// XLA FFI handler for remixer_t5/cpu_threefry.py: an identity that XLA cannot fuse through.
//
// A dropout mask is a hash of its positions (Threefry-2x32, unrolled on CPU so that XLA fuses it into the loop
// that compares the bits with the keep rate). The mask is read twice in a train step, by the forward select
// and by the backward one, and XLA's fusion duplicates a cheap elementwise producer into each consumer: the
// whole hash ran twice per mask. Passed through this custom call, the mask is one buffer: the hash and the
// comparison run once, in one loop that writes it, and both selects read it.
//
// The operand is aliased to the result (`input_output_aliases`), so normally nothing moves; when XLA gives the
// result its own buffer the bytes are copied.
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Materialize(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (in.size_bytes() != out->size_bytes()) {
    return ffi::Error::InvalidArgument("remixer_materialize: the result's size differs from the operand's");
  }
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerMaterialize, Materialize,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
