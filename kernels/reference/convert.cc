#include "reference/convert.h"

namespace attnd::reference {

const std::array<float, 256>& Fp8E4M3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code) values[code] = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    return values;
  }();
  return table;
}

}  // namespace attnd::reference
