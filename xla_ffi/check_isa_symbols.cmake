# Fails the build when an ISA-specific object (*_avx512.cc, *_avx2.cc) defines a weak
# symbol (nm classes W, V, u): see xla_ffi/src/isa_scratch.h for why that can put AVX-512
# code on a portable path. Run by CMakeLists.txt after linking: cmake -DNM=... -DOBJECTS=a|b -P
string(REPLACE "|" ";" objects "${OBJECTS}")
list(LENGTH objects n)
if(n EQUAL 0)
  message(FATAL_ERROR "check_isa_symbols: no objects given")
endif()
foreach(obj ${objects})
  execute_process(COMMAND ${NM} --defined-only -C ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_isa_symbols: ${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${syms}")
  foreach(line ${lines})
    # DW.ref.__gxx_personality_v0 is the exception personality pointer: data, no ISA code.
    if(line MATCHES "^[0-9a-fA-F]+ [WVu] " AND NOT line MATCHES "DW\\.ref\\.__gxx_personality_v0")
      message(FATAL_ERROR "check_isa_symbols: ${obj} defines a weak symbol compiled with its ISA "
                          "flags, which portable code may end up calling (xla_ffi/src/isa_scratch.h):\n  ${line}")
    endif()
  endforeach()
endforeach()
