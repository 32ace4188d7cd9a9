//! On a machine without the CUDA driver, opening a model fails cleanly — an `Unsupported`
//! error naming the library that was looked for, never a panic (cudarc panics when the driver
//! library is missing; the plugin probes first) — and the plugin still describes itself.
//! Skipped, with a message, where a driver is installed.

mod common;

use common::*;
use specula_cuda_hybrid::driver;
use specula_plugin_api::{ErrorKind, PluginKind};

fn driver_present() -> bool {
    if driver::probe_driver().is_ok() {
        eprintln!("SKIPPED: a CUDA driver is installed here; the no-driver path is not exercised");
        return true;
    }
    false
}

fn assert_no_driver_error(err: &specula_plugin_api::PluginError) {
    assert_eq!(err.kind, ErrorKind::Unsupported, "{}", err.message);
    assert!(
        err.message.contains("no CUDA driver found") && err.message.contains("libcuda.so.1"),
        "{}",
        err.message
    );
}

#[test]
fn opening_without_a_driver_is_a_clear_error() {
    if driver_present() {
        return;
    }
    let err =
        specula_cuda_hybrid::open(&params(&fixture("tiny-qwen35-mtp.gguf"), 0, &[])).unwrap_err();
    assert_no_driver_error(&err);
    // Asked twice (the probe result is cached), same answer.
    let err =
        specula_cuda_hybrid::open(&params(&stories(), 0, &[("gpu_layers", "2")])).unwrap_err();
    assert_no_driver_error(&err);
}

#[test]
fn the_root_module_describes_itself_and_refuses_cleanly() {
    let module = specula_cuda_hybrid::plugin_module();
    let info = (module.info())();
    assert_eq!(info.name.as_str(), "cuda-hybrid");
    assert_eq!(info.kind, PluginKind::Backend);
    assert!(info.description.contains("GPU"), "{}", info.description);
    if driver_present() {
        return;
    }
    let open = module.open_backend().into_option().expect("a backend");
    match open(&params(&stories(), 0, &[])).into_result() {
        Ok(_) => panic!("opened without a driver"),
        Err(err) => assert_no_driver_error(&err),
    }
}
