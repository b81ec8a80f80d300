// XLA FFI handler for kernels/cpu/threefry.py: an identity that XLA cannot fuse through, so that a dropout mask
// (an unrolled hash of its positions) is computed once into one buffer that both the forward and the backward
// select read, instead of fused into each (threefry.py's docstring). The operand is aliased to the result
// (`input_output_aliases`), so normally nothing moves; when XLA gives the result its own buffer the bytes are copied.
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
