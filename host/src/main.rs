fn main() -> std::process::ExitCode {
    specula_host::cli::main()
}
