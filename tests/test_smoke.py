import specdec_inductor


def test_import_reports_isa():
    assert specdec_inductor.active_isa() in specdec_inductor.built_isas()
