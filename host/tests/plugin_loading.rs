//! Loading plugins through the host's loader: the real cpu-simd library, libraries built
//! against another ABI, libraries that are not plugins, and files that are not libraries.

use abi_stable::std_types::RVec;
use specula_host::plugins::{
    backend_params, library_file_name, load_library, PluginError, SearchPath,
};
use specula_plugin_api::{ErrorKind, LogitRows, PluginKind, SequenceCalls, ABI_VERSION};
mod common;

use common::*;

/// Where the plugin called `name` would be a library in `dir` (`libspecula_NAME.so` on Linux).
fn library_path(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    dir.join(format!(
        "{}specula_{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

#[test]
fn cpu_simd_loads_and_evaluates_across_the_abi() {
    let plugin = load_library(&plugin_library("cpu-simd")).unwrap();
    let info = plugin.info();
    assert_eq!(info.name.as_str(), "cpu-simd");
    assert_eq!(info.kind, PluginKind::Backend);

    let params = backend_params(&shared("models/stories260K.gguf"), 2, 256, 8, vec![]);
    let mut backend = plugin.open_backend(&params).unwrap();
    let seq = backend.seq_create().into_result().unwrap();
    let model = backend.model_info();
    assert_eq!(model.architecture.as_str(), "llama");
    assert_eq!(model.vocab_size, 512);
    assert_eq!(model.context_size, 256);

    // Verify rows through the ABI are bit-identical to single-token evals.
    let prompt = [1u32, 403, 407, 261, 378];
    let mut batch = RVec::new();
    backend
        .eval(seq, &prompt, LogitRows::All, &mut batch)
        .into_result()
        .unwrap();
    assert_eq!(batch.len(), prompt.len() * 512);
    backend.truncate(seq, 0).into_result().unwrap();
    let mut single = RVec::new();
    for (i, &t) in prompt.iter().enumerate() {
        backend
            .eval(seq, &[t], LogitRows::Last, &mut single)
            .into_result()
            .unwrap();
        let row = &batch[i * 512..(i + 1) * 512];
        assert!(
            row.iter()
                .zip(single.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i}"
        );
    }

    // Bad input comes back as errors, not panics.
    let err = backend
        .eval(seq, &[9999], LogitRows::Last, &mut single)
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    let err = backend.truncate(seq, 1000).into_result().unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    let mut hidden = RVec::new();
    let err = backend
        .mtp_eval(
            seq,
            &[0.0; 64],
            &[1],
            0,
            LogitRows::All,
            &mut single,
            &mut hidden,
        )
        .into_result()
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported);
    assert!(!backend.capabilities().mtp_head);
}

#[test]
fn opening_a_missing_model_is_an_error_naming_it() {
    let plugin = load_library(&plugin_library("cpu-simd")).unwrap();
    let params = backend_params(std::path::Path::new("/no/such/model.gguf"), 1, 0, 8, vec![]);
    let err = match plugin.open_backend(&params) {
        Ok(_) => panic!("opened a missing model"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("/no/such/model.gguf"), "{err}");
}

#[test]
fn plugin_built_against_another_abi_is_refused_with_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let lib = library_path(dir.path(), "old");
    let other = ABI_VERSION + 41;
    compile_cdylib(
        &format!(
            "#[no_mangle]\npub extern \"C\" fn specula_plugin_abi_version() -> u32 {{ {other} }}\n"
        ),
        &lib,
    );
    let err = load_library(&lib).unwrap_err();
    assert!(
        matches!(err, PluginError::AbiMismatch { plugin, host, .. } if plugin == other && host == ABI_VERSION),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains(lib.to_str().unwrap()), "{text}");
    assert!(
        text.contains(&format!("ABI version {other}"))
            && text.contains(&format!("ABI version {ABI_VERSION}")),
        "{text}"
    );

    // `specula plugins` reports it as rejected, and a profile naming it fails clearly.
    let profile = dir.path().join("p.toml");
    std::fs::write(
        &profile,
        format!(
            "plugin_dir = \".\"\n[target]\nbackend = \"old\"\nmodel = {:?}\n",
            shared("models/stories260K.gguf").to_str().unwrap()
        ),
    )
    .unwrap();
    let out = specula(
        &["plugins", "--profile", profile.to_str().unwrap()],
        dir.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let listing = stdout(&out);
    assert!(
        listing.contains("rejected:") && listing.contains(&format!("ABI version {other}")),
        "{listing}"
    );
    assert!(listing.contains("cpu-simd"), "{listing}");
    let out = specula(
        &["run", "--profile", profile.to_str().unwrap(), "-n", "2"],
        dir.path(),
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("ABI version {other}")),
        "{}",
        stderr(&out)
    );
}

/// A library that exports the ABI version but forgot the export macro gets a line saying so
/// (it had been a multi-line abi_stable report about a mangled symbol in a temporary copy).
#[test]
fn a_plugin_without_its_module_says_which_macro_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let lib = library_path(dir.path(), "noroot");
    compile_cdylib(
        &format!(
            "#[no_mangle]\npub extern \"C\" fn specula_plugin_abi_version() -> u32 {{ {ABI_VERSION} }}\n"
        ),
        &lib,
    );
    let err = load_library(&lib).unwrap_err();
    assert!(matches!(err, PluginError::NoRootModule { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(lib.to_str().unwrap())
            && text.contains("export_drafter!")
            && !text.contains('\n'),
        "{text}"
    );
}

#[test]
fn a_library_that_is_not_a_plugin_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let lib = library_path(dir.path(), "stranger");
    compile_cdylib(
        "#[no_mangle]\npub extern \"C\" fn hello() -> u32 { 7 }\n",
        &lib,
    );
    let err = load_library(&lib).unwrap_err();
    assert!(matches!(err, PluginError::NotAPlugin { .. }), "{err}");
    assert!(err.to_string().contains("not a Specula plugin"), "{err}");
    assert!(err.to_string().contains(lib.to_str().unwrap()), "{err}");
}

#[test]
fn a_file_that_is_not_a_library_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fake = library_path(dir.path(), "fake");
    std::fs::write(&fake, b"this is text, not ELF").unwrap();
    let err = load_library(&fake).unwrap_err();
    assert!(matches!(err, PluginError::BadImage { .. }), "{err}");
    assert!(err.to_string().contains(fake.to_str().unwrap()), "{err}");
    assert!(
        err.to_string().contains("not an ELF shared library"),
        "{err}"
    );

    let search = SearchPath::from_dirs([dir.path().to_path_buf()]);
    let err = search.load("fake", PluginKind::Backend).unwrap_err();
    assert!(err.to_string().contains("refused before loading"), "{err}");
}

/// A library cut short maps segments past the end of its file: the system loader would take
/// it, and the process would die of SIGBUS. It must be refused before the loader sees it,
/// in-process and in `specula plugins` (listed as rejected, with the reason).
#[test]
fn a_truncated_library_is_refused_before_the_loader_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let whole = std::fs::read(plugin_library("drafter-lookup")).unwrap();
    let cut = dir.path().join(library_file_name("trunc"));
    std::fs::write(&cut, &whole[..4096]).unwrap();
    let err = load_library(&cut).unwrap_err();
    assert!(matches!(err, PluginError::BadImage { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(cut.to_str().unwrap()), "{text}");
    assert!(text.contains("runs past the end of the file"), "{text}");

    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(specula_bin())
        .arg("plugins")
        .env("SPECULA_HOME", home.path())
        .env("SPECULA_PLUGIN_PATH", dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listing = stdout(&out);
    let rejected = listing
        .lines()
        .skip_while(|l| !l.starts_with("rejected"))
        .find(|l| l.contains("libspecula_trunc"))
        .unwrap_or_else(|| panic!("the truncated library is not listed as rejected:\n{listing}"));
    assert!(rejected.contains("truncated?"), "{rejected}");
}

/// A new build copied over an old one at the same path (in place, as `cp` does) is a new
/// library: loading the path again gives the new code, not the cached old one.
#[test]
fn a_library_replaced_at_the_same_path_is_loaded_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(library_file_name("swapped"));
    std::fs::copy(plugin_library("drafter-lookup"), &path).unwrap();
    let first = load_library(&path).unwrap();
    assert_eq!(first.info().name.as_str(), "lookup");
    assert_eq!(load_library(&path).unwrap().identity(), first.identity());

    // Rewrite the same inode with another plugin's bytes.
    std::fs::write(&path, std::fs::read(plugin_library("drafter-mtp")).unwrap()).unwrap();
    let second = load_library(&path).unwrap();
    assert_eq!(second.info().name.as_str(), "mtp");
    assert_ne!(second.identity(), first.identity());
    let provenance = second.provenance();
    assert_eq!(provenance.size, std::fs::metadata(&path).unwrap().len());
    assert!(
        provenance.to_string().starts_with("mtp 0.1.0 ("),
        "{provenance}"
    );
    // The library loaded first still works: its code was loaded from a private copy.
    assert_eq!(first.info().name.as_str(), "lookup");
}

#[test]
fn a_backend_is_refused_where_a_drafter_is_expected() {
    let search = SearchPath::from_dirs([plugin_dir()]);
    let err = search.load("cpu-simd", PluginKind::Drafter).unwrap_err();
    assert!(matches!(err, PluginError::WrongKind { .. }), "{err}");
    assert!(err.to_string().contains("is a backend plugin"), "{err}");
}

/// A plugin is selected by its file name, and listed by it: a copy of the lookup drafter saved
/// as `libspecula_lookup_copy.so` is `lookup-copy` (also `lookup_copy`) in the listing and in
/// profiles, with a note that it calls itself `lookup`; two libraries answering to one name
/// get a warning naming the one profiles get.
#[test]
fn a_plugin_is_listed_and_selected_by_one_name() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(library_file_name("lookup_copy"));
    std::fs::copy(plugin_library("drafter-lookup"), &copy).unwrap();
    // A second library answering to `lookup`, in a directory searched first.
    let first = tempfile::tempdir().unwrap();
    let shadow = first.path().join(library_file_name("lookup"));
    std::fs::copy(plugin_library("drafter-lookup"), &shadow).unwrap();
    let search = SearchPath::from_dirs([
        first.path().to_path_buf(),
        dir.path().to_path_buf(),
        plugin_dir(),
    ]);
    for name in ["lookup-copy", "lookup_copy"] {
        let plugin = search.load(name, PluginKind::Drafter).unwrap();
        assert_eq!(plugin.path(), copy.as_path());
    }
    assert_eq!(
        search.load("lookup", PluginKind::Drafter).unwrap().path(),
        shadow.as_path()
    );

    let home = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(specula_bin())
        .arg("plugins")
        .env("SPECULA_HOME", home.path())
        .env(
            "SPECULA_PLUGIN_PATH",
            std::env::join_paths([first.path(), dir.path(), plugin_dir().as_path()]).unwrap(),
        )
        .output()
        .unwrap();
    let listing = stdout(&out);
    let row = listing
        .lines()
        .find(|l| l.contains("libspecula_lookup_copy"))
        .unwrap_or_else(|| panic!("the copy is not listed:\n{listing}"));
    assert!(row.starts_with("lookup-copy "), "{row}");
    assert!(
        listing.contains(
            "calls itself 'lookup'; profiles select it by its file name, as 'lookup-copy'"
        ),
        "{listing}"
    );
    let warning = listing
        .lines()
        .find(|l| l.starts_with("warning:"))
        .unwrap_or_else(|| panic!("no warning about the two 'lookup's:\n{listing}"));
    assert!(
        warning.contains("answer to the drafter name 'lookup'")
            && warning.ends_with(&format!("get {}", shadow.display())),
        "{warning}"
    );
    // The same library reached through hard links (target/*/ and target/*/deps/) is one
    // library, not a conflict.
    assert!(!listing.contains("name 'cpu-simd'"), "{listing}");
}
